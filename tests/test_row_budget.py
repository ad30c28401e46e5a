"""Budgeted verification rows (`hycoc.verifier.row_budget`, `verify_batch(..., budget=...)`).

The allocation is checked against a brute force over every ancestor-closed choice of rows; the engine's trimmed
rounds against the same sub-tree sent alone (bit for bit at T = 0), exact acceptance on trimmed trees against p~
(chi-square), and T = 0 text with trimming on against the untrimmed run's.
"""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
import torch
from hycoc.verifier import VerifierEngine
from hycoc.verifier.batch import BatchStats, RowBudget, verify_batch
from hycoc.verifier.row_budget import (
    BudgetState,
    RowCost,
    RowCostError,
    allocate,
    is_ancestor_closed,
    monotone_scores,
    row_values,
)
from hycoc.verifier.sampling import sampling_probs
from hycoc.verifier.tree_rows import remap_parents
from scipy.stats import chisquare
from test_verifier_engine import pooled_chisquare
from tiny_models import VOCAB, tiny_verifier

from hycoc.protocol.messages import Sampling

torch.set_num_threads(1)
LN = float(np.log(0.66))
SCALES = (0.1, 0.1, 0.05, 0.05, 0.05, 0.05)


# ---------------------------------------------------------------------------------------------- the cost line


def test_row_cost_interpolates_holds_and_extends():
    cost = RowCost(((32, 14.0), (144, 26.0), (528, 70.0)))
    assert cost.ms([1, 32, 88, 144, 528, 1056]).tolist() == pytest.approx(
        [14.0, 14.0, 20.0, 26.0, 70.0, 70.0 + 44.0 / 384 * 528]
    )
    assert cost.flat_rows() == 32
    gpu = RowCost(((33, 20.0), (132, 20.4), (206, 20.9), (528, 50.0)))
    assert gpu.flat_rows() == 206  # within 5 % of the first point up to the ridge
    falling = RowCost(((10, 5.0), (20, 4.0)))
    assert falling.ms(40).item() == 4.0  # slope beyond the last point clamped to >= 0


@pytest.mark.parametrize(
    "points, field",
    [
        (((10, 1.0),), "at least two"),
        (((10, 1.0), (10, 2.0)), "increasing"),
        (((10, 1.0), (20, -1.0)), "finite and >= 0"),
        (((0, 1.0), (20, 2.0)), ">= 1"),
    ],
)
def test_row_cost_refuses_bad_points(points, field):
    with pytest.raises(RowCostError, match=field):
        RowCost(points)


def test_recipe_row_cost_without_a_line_is_a_recipe_error():
    """[verifier].row_cost points that pass the recipe's schema but make no cost line (rows not increasing) are a
    RecipeError naming the key, as every bad recipe value is (it was an AttributeError: the error got a str where
    it takes its list of problems)."""
    from types import SimpleNamespace

    from hycoc.verifier.loading import row_cost_of

    from hycoc.recipe import RecipeError

    recipe = SimpleNamespace(verifier=SimpleNamespace(row_cost=[[10.0, 1.0], [10.0, 2.0]]))
    with pytest.raises(RecipeError, match="verifier.row_cost: .*increasing") as e:
        row_cost_of(recipe)
    assert e.value.key == "verifier.row_cost"


# ---------------------------------------------------------------------------------------------- the allocation


def chain_tree(depth: int, leaves: list[float], root: int = 5):
    """A chain of `depth` rows (scores k ln λ) and SLM leaves under the chain's end with the given log-scores
    (relative to that end)."""
    tokens = [root] + [10 + k for k in range(depth)] + [50 + k for k in range(len(leaves))]
    parents = [-1] + list(range(depth)) + [depth] * len(leaves)
    scores = [0.0] + [k * LN for k in range(1, depth + 1)] + [depth * LN + s for s in leaves]
    return np.array(scores), np.array(tokens), np.array(parents)


def closed_subsets(parents: np.ndarray, forced: set[int]):
    """Every ancestor-closed set of rows of a tree containing `forced` (brute force, small trees)."""
    rows = range(1, len(parents))
    for k in range(len(parents)):
        for extra in itertools.combinations(rows, k):
            kept = {0} | set(extra)
            if forced <= kept and all(parents[r] in kept for r in kept if r):
                yield sorted(kept)


def brute_force_ratio(trees, cost, free_rows, min_rows):
    """The best (sessions + expected tokens) / cost(rows) over all ancestor-closed choices keeping each scored
    tree's `min_rows` best rows and >= free_rows rows in all (or everything when the step fits in free_rows)."""
    total = sum(len(t) for _, t, _ in trees)
    options = []
    for scores, tokens, parents in trees:
        s = monotone_scores(scores, parents)
        order = np.lexsort((np.arange(len(s)), -s))
        order = np.concatenate([[0], order[order != 0]])
        forced = set(order[:min_rows].tolist())
        v = row_values(s, tokens, parents)
        options.append([(len(k), float(v[k].sum())) for k in closed_subsets(parents, forced)])
    best = 0.0
    for combo in itertools.product(*options):
        rows = sum(r for r, _ in combo)
        if rows < min(free_rows, total):
            continue
        best = max(best, (len(trees) + sum(v for _, v in combo)) / float(cost.ms(rows)))
    return best


def test_allocation_hand_worked():
    """Two trees: a 4-chain with two unlikely SLM leaves (exp(s) = 0.19 x 0.02 and 0.19 x 0.01). Cost 10 ms + 1 ms
    per row. Chain values 0.66, 0.4356, 0.2875, 0.1897. The floor, 4 rows (root + first chain token each):
    (2 + 2 x 0.66) / 14 = 0.2371; 6 rows: 4.1912 / 16 = 0.2620; 8 rows: 4.7662 / 18 = 0.2648; 10 rows:
    5.1457 / 20 = 0.2573; all 14: 5.1571 / 24 = 0.2149. So 8 rows: the root and three chain tokens per tree."""
    a, b = chain_tree(4, [np.log(0.02), np.log(0.01)]), chain_tree(4, [np.log(0.02), np.log(0.01)], root=6)
    cost = RowCost(((1, 11.0), (100, 110.0)))
    got = allocate([a, b], cost, free_rows=4, min_rows=2)
    assert [k.tolist() for k in got.kept] == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert (got.rows_before, got.rows_after, got.trimmed) == (14, 8, 6)
    assert got.expected_tokens == pytest.approx(2 + 2 * (0.66 + 0.66**2 + 0.66**3))
    assert got.expected_tokens / float(cost.ms(8)) == pytest.approx(0.26479, abs=1e-5)
    # free rows: never fewer than 10 in all, so the next-best rows (the fourth chain tokens) come back
    got10 = allocate([a, b], cost, free_rows=10, min_rows=2)
    assert [k.tolist() for k in got10.kept] == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]
    # a step that fits in its free rows is verified as sent
    assert allocate([a, b], cost, free_rows=14).kept == [None, None]
    # one tree alone with free_rows = its rows (the server's rule) is never trimmed
    assert allocate([a], cost, free_rows=7).kept == [None]


def test_unscored_trees_stay_whole_and_padding_goes_first():
    a = chain_tree(3, [np.log(0.5)])
    tokens = np.concatenate([a[1], [a[1][-1]] * 3])  # padded: the last row repeated three times
    parents = np.concatenate([a[2], [a[2][-1]] * 3])
    scores = np.concatenate([a[0], [a[0][-1]] * 3])
    unscored = (None, np.array([7, 8, 9]), np.array([-1, 0, 1]))
    cost = RowCost(((1, 1.0), (100, 100.0)))  # 1 ms per row: every row below 1 expected token per ms... trims
    got = allocate([(scores, tokens, parents), unscored], cost, free_rows=8)
    assert got.kept[1] is None  # the unscored tree is kept whole
    assert got.rows_after == 8 and got.kept[0].tolist() == [0, 1, 2, 3, 4]  # padding (rows 5-7) left out first
    assert row_values(scores, tokens, parents)[5:].tolist() == [0.0, 0.0, 0.0]


def test_allocation_is_ancestor_closed_and_optimal_on_random_trees():
    rng = np.random.default_rng(0)
    for trial in range(60):
        trees = []
        for _ in range(int(rng.integers(2, 4))):
            rows = int(rng.integers(2, 7))
            parents = np.array([-1] + [int(rng.integers(0, j)) for j in range(1, rows)])
            raw = np.concatenate([[0.0], -rng.exponential(1.0, rows - 1)])
            scores = np.zeros(rows)
            for j in range(1, rows):  # s(child) = s(parent) + log q + ln λ
                scores[j] = scores[parents[j]] + raw[j] + LN
            tokens = np.concatenate([[1], rng.permutation(np.arange(10, 10 + rows - 1))])
            trees.append((scores, tokens, parents))
        fixed = float(rng.uniform(0.5, 20))
        slope = float(rng.uniform(0.05, 3))
        cost = RowCost(((1, fixed), (64, fixed + 63 * slope)))
        min_rows = int(rng.integers(1, 3))
        free = int(rng.integers(1, 8))
        got = allocate(trees, cost, free_rows=free, min_rows=min_rows)
        ratio = got.expected_tokens / float(cost.ms(got.rows_after))
        for (_scores, tokens, parents), kept in zip(trees, got.kept):
            rows = np.arange(len(tokens)) if kept is None else kept
            assert is_ancestor_closed(parents, rows) and len(rows) >= min(min_rows, len(tokens)), (trial, rows)
        assert got.rows_after >= min(free, got.rows_before)
        assert ratio == pytest.approx(brute_force_ratio(trees, cost, free, min_rows), rel=1e-9), trial


def test_allocation_refuses_bad_arguments():
    a = chain_tree(2, [])
    with pytest.raises(ValueError, match="min_rows"):
        allocate([a], RowCost(((1, 1.0), (2, 2.0))), free_rows=1, min_rows=0)
    with pytest.raises(ValueError, match="free_rows"):
        allocate([a], RowCost(((1, 1.0), (2, 2.0))), free_rows=0)


# ---------------------------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def model():
    return tiny_verifier(sharpen=3.0)


def make_engine(model) -> VerifierEngine:
    return VerifierEngine(model, head_window=6, handoff_scales=SCALES, eos_token_ids=set(), max_context=128)


@torch.inference_mode()
def greedy_tree(model, tokens, depth=4, width=2):
    """The verifier's own top-`width` at each level of its greedy chain, with Alg. 3-like scores: the chain
    k ln λ, the runner-ups 2 ln λ below their parent."""
    tokens = list(tokens)
    tree, parents, scores, parent = [tokens[-1]], [-1], [0.0], 0
    for _ in range(depth):
        top = model(input_ids=torch.tensor([tokens])).logits[0, -1].topk(width).indices.tolist()
        first = len(tree)
        for i, tok in enumerate(top):
            tree.append(tok)
            parents.append(parent)
            scores.append(scores[parent] + (LN if i == 0 else 2 * LN))
        parent = first
        tokens.append(top[0])
    return np.array(tree), np.array(parents), np.array(scores)


#: A steep cost line: rows cost as much as the whole forward's fixed part, so most rows are trimmed.
STEEP = RowBudget(RowCost(((1, 1.0), (100, 100.0))), free_rows=1, min_rows=2, learn=False)


def test_a_trimmed_round_equals_the_subtree_sent_alone(model):
    """T = 0, three sessions batched with a steep budget: each reply equals (bit for bit, in the kept rows) the
    reply of the same session sent only its kept rows, and says which rows were verified."""
    eng, ref = make_engine(model), make_engine(model)
    prompts = [[50, 61, 72], [3, 4, 5, 6, 7], [90, 91]]
    greedy = Sampling(temperature=0.0)
    sessions = [eng.open(p, sampling=greedy, acceptance="exact") for p in prompts]
    alone = [ref.open(p, sampling=greedy, acceptance="exact") for p in prompts]
    for s in sessions + alone:
        s.prefill()
    trimmed_rows = 0
    for seq in range(3):
        trees = [greedy_tree(model, s.tokens) for s in sessions]
        stats = BatchStats()
        replies = verify_batch(eng, [(s, t, p, seq, sc) for s, (t, p, sc) in zip(sessions, trees)], stats, STEEP)
        assert stats.rows_sent == sum(len(t) for t, _, _ in trees) and stats.rows == sum(stats.rows_kept)
        trimmed_rows += stats.rows_sent - stats.rows
        for s, a, (t, p, _sc), reply in zip(sessions, alone, trees, replies):
            assert not isinstance(reply, BaseException), reply
            kept = np.nonzero(reply.verified)[0] if reply.verified is not None else np.arange(len(t))
            assert is_ancestor_closed(p, kept) and set(reply.path_rows.tolist()) <= set(kept.tolist())
            assert (reply.samples[~np.isin(np.arange(len(t)), kept)] == t[~np.isin(np.arange(len(t)), kept)]).all()
            small = a.verify(t[kept], remap_parents(p, kept), seq)
            assert reply.samples[kept].tolist() == small.samples.tolist()
            assert kept[small.path_rows].tolist() == reply.path_rows.tolist() and reply.bonus == small.bonus
            assert s.tokens == a.tokens
    assert trimmed_rows > 0


def test_t0_text_with_trimming_equals_the_untrimmed_run(model):
    """Exact acceptance at T = 0 commits the verifier's greedy text whatever the tree: trimming changes how many
    rounds it takes, never the text."""
    eng_b, eng_f = make_engine(model), make_engine(model)
    prompts = [[50, 61, 72], [3, 4, 5, 6, 7], [90, 91], [17]]
    greedy = Sampling(temperature=0.0)

    def run(engine, budget):
        sessions = [engine.open(p, sampling=greedy, acceptance="exact") for p in prompts]
        for s in sessions:
            s.prefill()
        seqs = [0] * len(sessions)
        while min(len(s.output) for s in sessions) < 12:
            batch = []
            for i, s in enumerate(sessions):
                t, p, sc = greedy_tree(model, s.tokens, depth=3)
                t[1] = (t[1] + 7) % VOCAB  # a wrong first chain token: the siblings must carry it
                batch.append((s, t, p, seqs[i], sc))
                seqs[i] += 1
            verify_batch(engine, batch, None, budget)
        return [s.output[:12] for s in sessions], sum(seqs)

    budgeted, rounds_b = run(eng_b, STEEP)
    fixed, rounds_f = run(eng_f, None)
    assert budgeted == fixed
    assert rounds_b >= rounds_f


def test_exact_acceptance_with_trimming_is_lossless(model):
    """The first two tokens committed by exact acceptance on trimmed trees ~ p~ (chi-square, n = 400 per cell):
    the session's tree is every first-level candidate plus two children under the likeliest, with scores (log p~
    of each first-level row, a likely and an unlikely child) that make the budget keep the root, the likelier
    first-level rows and the likely child only; a filler session shares the forward (a budget acts on batches)."""
    sampling = Sampling(temperature=1.0, top_k=4, top_p=0.9)
    prompt = [50, 61, 72]
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1:].float()
    p1 = sampling_probs(logits, sampling)[0]
    support1 = p1.nonzero().flatten().tolist()
    top = max(support1, key=lambda x: float(p1[x]))
    with torch.inference_mode():
        p2 = {
            x: sampling_probs(model(input_ids=torch.tensor([prompt + [x]])).logits[0, -1:].float(), sampling)[0]
            for x in support1
        }
    below = p2[top].topk(2).indices.tolist()
    expected = {(x, y): float(p1[x] * p2[x][y]) for x in support1 for y in p2[x].nonzero().flatten().tolist()}
    order = sorted(support1, key=lambda x: -float(p1[x]))
    tokens = np.array([prompt[-1]] + order + below)
    parents = np.array([-1] + [0] * len(order) + [1] * 2)
    scores = np.array([0.0] + [np.log(float(p1[x])) for x in order] + [np.log(float(p1[top])) - 0.1, -30.0])
    budget = RowBudget(RowCost(((1, 10.0), (100, 109.0))), free_rows=1, min_rows=1, learn=False)
    engine = make_engine(model)
    n = 400
    counts, kept_shapes = Counter(), Counter()
    for seed in range(n):
        s = engine.open(prompt, sampling=sampling, seed=seed, acceptance="exact")
        filler = engine.open([9, 8, 7], sampling=sampling, seed=seed, acceptance="exact")
        s.prefill()
        filler.prefill()
        seq = 0
        while len(s.output) < 2:
            root = s.root
            t = tokens.copy() if seq == 0 else np.array([root, 3, 4])
            t[0] = root
            p = parents if seq == 0 else np.array([-1, 0, 0])
            sc = scores if seq == 0 else np.array([0.0, -1.0, -2.0])
            ft = np.array([filler.root, 5, 6])
            replies = verify_batch(
                engine,
                [(s, t, p, seq, sc), (filler, ft, np.array([-1, 0, 1]), seq, np.array([0.0, -0.5, -1.0]))],
                None,
                budget,
            )
            if seq == 0:
                v = replies[0].verified
                kept_shapes[tuple(np.nonzero(v)[0]) if v is not None else "all"] += 1
            seq += 1
        counts[tuple(s.output[:2])] += 1
        s.close()
        filler.close()
    # trimmed the same way every time: the root, the likeliest first-level row and its likely child stay, the
    # unlikely child (score -30) goes
    assert len(kept_shapes) == 1, kept_shapes
    shape = next(iter(kept_shapes))
    assert {0, 1, len(order) + 1} <= set(shape) and len(order) + 2 not in shape, (shape, len(tokens))
    assert set(counts) <= set(expected), "committed a pair outside p~'s support"
    assert pooled_chisquare(counts, expected, n).pvalue > 1e-3, counts
    firsts = Counter(k[0] for k in counts.elements())
    stat = chisquare([firsts[x] for x in support1], np.array([float(p1[x]) for x in support1]) * n)
    assert stat.pvalue > 1e-3, firsts


def test_budget_state_learns_overhead_and_acceptance():
    """The EMA starts at the first step's values, then moves by its weight; value_scale is clamped to [0.05, 2]."""
    st = BudgetState(weight=0.5)
    st.observe(step_ms=30.0, forward_ms=10.0, sessions=4, accepted=3.0, expected=6.0)
    assert (st.overhead_ms, st.value_scale, st.steps) == (5.0, 0.5, 1)
    st.observe(step_ms=20.0, forward_ms=10.0, sessions=2, accepted=30.0, expected=1.0)  # ratio 30 -> clamped 2
    assert (st.overhead_ms, st.value_scale) == (5.0, 1.25)
    st.observe(step_ms=12.0, forward_ms=10.0, sessions=1, accepted=None, expected=None)  # unscored: scale kept
    assert (st.overhead_ms, st.value_scale) == (3.5, 1.25)
    # and the allocation weighs rows against the whole step: a large per-step overhead keeps more rows
    a, b = chain_tree(4, []), chain_tree(4, [], root=6)
    cost = RowCost(((1, 11.0), (100, 110.0)))
    lean = allocate([a, b], cost, free_rows=2)
    heavy = allocate([a, b], cost, free_rows=2, extra_ms=200.0)
    assert lean.rows_after == 8 and heavy.rows_after == 10
    half = allocate([a, b], cost, free_rows=2, value_scale=0.5)
    assert half.rows_after < lean.rows_after and half.expected_tokens < lean.expected_tokens


def test_a_budgeted_batch_teaches_the_state(model):
    """verify_batch with learn=True updates the budget's state from the step (overhead > 0, value_scale moved
    from 1 towards accepted / expected)."""
    eng = make_engine(model)
    greedy = Sampling(temperature=0.0)
    sessions = [eng.open(p, sampling=greedy, acceptance="exact") for p in ([50, 61, 72], [3, 4, 5, 6])]
    for s in sessions:
        s.prefill()
    budget = RowBudget(RowCost(((1, 1.0), (100, 100.0))), free_rows=1, min_rows=2)
    trees = [greedy_tree(model, s.tokens) for s in sessions]
    stats = BatchStats()
    verify_batch(eng, [(s, t, p, 0, sc) for s, (t, p, sc) in zip(sessions, trees)], stats, budget)
    assert budget.state.steps == 1 and budget.state.overhead_ms > 0
    accepted = sum(s.accepted[-1] for s in sessions)
    expected = stats.expected_tokens - 2
    assert budget.state.value_scale == pytest.approx(min(2.0, max(0.05, accepted / expected)))


def test_row_cost_plan_and_measurement_fit_the_engine(model):
    from hycoc.verifier.row_cost_measure import measure_row_cost, row_cost_plan

    assert row_cost_plan(33, 528, 32768) == (16, [2, 8, 16, 33])
    assert row_cost_plan(5, 528, 14) == (16, [2, 5])  # a short context still measures
    assert row_cost_plan(7, 14, 96) == (2, [2, 3, 7])
    with pytest.raises(ValueError, match="too short"):
        row_cost_plan(33, 528, 3)
    eng = VerifierEngine(model, head_window=6, handoff_scales=SCALES, eos_token_ids=set(), max_context=20)
    sessions, rows = row_cost_plan(9, 40, eng.max_context)
    cost = measure_row_cost(
        eng, sessions=sessions, rows_per_tree=rows, context=eng.max_context - rows[-1] - 1, repeats=1
    )
    assert [r for r, _ in cost.points] == [sessions * r for r in rows] and all(ms > 0 for _, ms in cost.points)
    assert "batch_forward of 4 sessions" in cost.source
