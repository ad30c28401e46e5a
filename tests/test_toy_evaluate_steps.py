"""The toy family's measuring steps (`hycoc.toy.evaluate`) that need no model, worked by hand."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hycoc.toy.evaluate import expected_chain_mat, handoff_scales  # noqa: E402


def test_expected_chain_mat_by_hand():
    # acceptance 0.5, 0.5, 1, 0: accepted prefixes 0.5, 0.25, 0.25, 0 -> 1 (bonus) + 1.0 = 2.0 tokens per round
    assert expected_chain_mat(torch.tensor([0.5, 0.5, 1.0, 0.0])) == pytest.approx(2.0)
    # a chain the verifier always accepts commits all K = 4 and the bonus
    assert expected_chain_mat(torch.ones(4)) == pytest.approx(5.0)


def test_handoff_scales_are_the_99_99th_percentile_over_127():
    # |x| = 0, 1, ..., 10000 (all kept: under 10**6 values): the 0.9999 quantile sits at 0.9999 x 10000 = 9999
    # exactly, so the scale is 9999 / 127 = 78.7322834... -> 78.732283
    x = torch.arange(10001, dtype=torch.float32)
    scales = handoff_scales({"h": [x[:5000], x[5000:]], "e": [torch.full((10,), 127.0)]})
    assert scales == {"h": 78.732283, "e": 1.0}  # a constant |x| = 127 gives the scale 1
