"""p~ (Alg. 4 line 5): temperature, top-k, top-p nucleus, greedy; seeded per-row sampling."""

import math

import numpy as np
import pytest
import torch
from hycoc.verifier.sampling import sample_rows, sampling_probs
from scipy.stats import chisquare

from hycoc.protocol.messages import Sampling

torch.set_num_threads(1)


def test_top_k_then_top_p_renormalized():
    # Probabilities 0.4, 0.3, 0.2, 0.1 for ids 5, 2, 7, 0; everything else far below.
    logits = torch.full((1, 10), -50.0)
    for i, p in zip([5, 2, 7, 0], [0.4, 0.3, 0.2, 0.1]):
        logits[0, i] = math.log(p)
    # top-k 3 renormalizes 0.4, 0.3, 0.2 over 0.9; nucleus 0.7: mass before id 7 is 0.7/0.9 = 0.78 >= 0.7, cut.
    probs = sampling_probs(logits, Sampling(temperature=1.0, top_k=3, top_p=0.7))
    expected = torch.zeros(1, 10)
    expected[0, 5], expected[0, 2] = 0.4 / 0.7, 0.3 / 0.7
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=0)
    # Nucleus 0.8 > 0.78: the third token stays.
    probs = sampling_probs(logits, Sampling(temperature=1.0, top_k=3, top_p=0.8))
    expected[0, 5], expected[0, 2], expected[0, 7] = 0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=0)
    assert probs.dtype == torch.float32


def test_temperature_without_truncation_is_softmax():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0)) * 3
    probs = sampling_probs(logits, Sampling(temperature=0.7, top_k=40, top_p=1.0))
    torch.testing.assert_close(probs, torch.softmax(logits / 0.7, -1), atol=1e-6, rtol=1e-5)


def test_ties_go_to_the_lowest_id():
    logits = torch.zeros(1, 6)
    logits[0, [1, 3, 4]] = 2.0
    probs = sampling_probs(logits, Sampling(temperature=1.0, top_k=2, top_p=1.0))
    assert probs[0].nonzero().flatten().tolist() == [1, 3]
    greedy = sampling_probs(logits, Sampling(temperature=0.0))
    assert greedy[0].tolist() == [0, 1, 0, 0, 0, 0]


def test_invalid_parameters_raise():
    with pytest.raises(ValueError):
        sampling_probs(torch.zeros(1, 4), Sampling(top_p=0.0))
    with pytest.raises(ValueError):
        sampling_probs(torch.zeros(1, 4), Sampling(top_k=0))


def test_sample_rows_follows_probs_and_is_seeded():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0]]).repeat(6000, 1)
    draws = sample_rows(probs, torch.Generator().manual_seed(7))
    assert draws.dtype == torch.int64 and draws.shape == (6000,)
    counts = np.bincount(draws.numpy(), minlength=6)
    assert counts[[0, 2, 5]].sum() == 0  # zero-mass tokens are never drawn
    stat = chisquare(counts[[1, 3, 4]], 6000 * np.array([0.5, 0.3, 0.2]))
    assert stat.pvalue > 1e-3, stat
    again = sample_rows(probs, torch.Generator().manual_seed(7))
    assert torch.equal(draws, again)


def test_one_hot_rows_always_draw_their_token():
    probs = torch.zeros(4, 9)
    probs[torch.arange(4), torch.tensor([8, 0, 3, 8])] = 1.0
    for seed in range(20):
        assert sample_rows(probs, torch.Generator().manual_seed(seed)).tolist() == [8, 0, 3, 8]
