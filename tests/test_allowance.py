"""The verifier's allowance rule (hycoc.verifier.allowance): hand-worked cases on a GPU-like cost line (flat to 206
rows, then linear) and a chain tree whose row values are 0.5 ** depth."""

import math

import numpy as np
import pytest
from hycoc.verifier.allowance import AllowanceRule
from hycoc.verifier.row_budget import BudgetState, RowCost

#: flat 10 ms up to 206 rows, then +10 ms per 206 rows (an H200-like ridge, hand-made).
COST = RowCost(((1, 10.0), (206, 10.0), (412, 20.0)))
CEILING, FLOOR = 33, 5


def chain_tree(rows: int = CEILING):
    """Root + a chain of rows - 1 tokens, s(depth d) = d ln 0.5: row values exp(s) = 0.5 ** d."""
    tokens = np.arange(100, 100 + rows)
    parents = np.arange(-1, rows - 1)
    scores = np.arange(rows) * math.log(0.5)
    return scores, tokens, parents


def rule(**kw) -> AllowanceRule:
    args = dict(cost=COST, free_rows=206, floor=FLOOR, ceiling=CEILING)
    args.update(kw)
    return AllowanceRule(**args)


def test_before_any_tree_and_at_low_load_the_whole_tree():
    r = rule()
    assert r.allowance(sessions=50) == CEILING  # nothing learned to rank yet
    r.observe_tree(*chain_tree())
    assert r.allowance(sessions=1) == CEILING
    assert r.allowance(sessions=6) == CEILING  # 6 x 33 = 198 rows fit the flat 206


def test_under_load_the_rows_that_maximise_tokens_per_ms():
    r = rule()
    r.observe_tree(*chain_tree())
    # V(r) = sum_{d=1}^{r-1} 0.5^d = 1 - 0.5^(r-1). At 10 sessions every r <= 20 keeps 10 r <= 206 rows in the flat
    # 10 ms, so the ratio 10 (2 - 0.5^(r-1)) / 10 rises to r = 20; r = 21 pays 10 + 4 x 10 / 206 ms for 0.5^20.
    assert r.allowance(sessions=10) == 20
    np.testing.assert_allclose(r.expected_tokens(np.array([1, 2, 20])), [0.0, 0.5, 1 - 0.5**19])
    # 40 sessions: past the flat part from r = 6 (240 rows); the ratio 40 (2 - 0.5^(r-1)) / cost(40 r) peaks at
    # the floor's 5 (200 rows, flat: 40 x 1.9375 / 10 = 7.75 tokens per ms): r = 6 adds 0.5^5 x 40 = 1.25 tokens
    # for 34 x 10 / 206 = 1.65 ms more, 78.75 / 11.65 = 6.76.
    assert r.allowance(sessions=40) == FLOOR


def test_a_target_bounds_the_step_and_falls_to_the_floor():
    r = rule(target_ms=5.0)
    r.observe_tree(*chain_tree())
    assert r.allowance(sessions=10) == FLOOR  # no r fits 5 ms: the floor
    r = rule(cost=RowCost(((1, 1.0), (100, 100.0))), free_rows=33, target_ms=50.0)
    r.observe_tree(*chain_tree())
    # cost = rows ms (slope 1 from (1, 1)); 4 sessions: the ratio 4 (2 - 0.5^(r-1)) / (4 r) falls with r, so the
    # floor wins with or without the target; the target keeps 4 r <= 50: r <= 12 (checked on a flat ratio below).
    assert r.allowance(sessions=4) == FLOOR
    flat = rule(cost=RowCost(((1, 1.0), (1000, 1.0))), free_rows=33, target_ms=50.0)
    flat.observe_tree(*chain_tree())
    assert flat.allowance(sessions=4) == CEILING  # no cost to rows: the whole tree, the target never binds


def test_value_scale_and_overhead_come_from_the_shared_budget_state():
    state = BudgetState()
    r = rule(budget=state)
    r.observe_tree(*chain_tree())
    state.value_scale = 0.0  # accepted tokens say rows are worth nothing: the floor
    assert r.allowance(sessions=10) == FLOOR
    np.testing.assert_allclose(r.expected_tokens(np.array([20])), [0.0])


def test_learning_ranks_and_sessions():
    r = rule(weight=0.5)
    r.observe_tree(*chain_tree(5))  # a tree sent under a 5-row allowance teaches ranks 1-4 only
    np.testing.assert_allclose(r.state.rank_values[:4], [0.5, 0.25, 0.125, 0.0625])
    assert np.isnan(r.state.rank_values[4:]).all()
    # unseen ranks count the last seen one's value
    np.testing.assert_allclose(r.expected_tokens(np.array([7])), [0.5 + 0.25 + 0.125 + 0.0625 * 3])
    scores, tokens, parents = chain_tree(5)
    r.observe_tree(scores * 2, tokens, parents)  # values 0.25^d, EMA weight 0.5
    np.testing.assert_allclose(r.state.rank_values[:2], [(0.5 + 0.25) / 2, (0.25 + 0.0625) / 2])
    r.observe_step(8)
    assert r.state.sessions == 8  # the first step sets the average
    r.observe_step(4)
    assert r.state.sessions == 6
    r.observe_step(0)  # ignored
    assert (r.state.sessions, r.state.steps) == (6, 2)


def test_padding_rows_are_worth_nothing():
    scores, tokens, parents = chain_tree(5)
    tokens = np.concatenate([tokens, [tokens[-1]] * 3])  # padded to 8 rows by repeating the last
    parents = np.concatenate([parents, [parents[-1]] * 3])
    scores = np.concatenate([scores, [scores[-1]] * 3])
    r = rule()
    r.observe_tree(scores, tokens, parents)
    np.testing.assert_allclose(r.state.rank_values[:7], [0.5, 0.25, 0.125, 0.0625, 0, 0, 0])


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(floor=0), "floor = 0"),
        (dict(floor=6, ceiling=5), "ceiling = 5"),
        (dict(free_rows=0), "free_rows = 0"),
        (dict(weight=0.0), "weight = 0.0"),
        (dict(yield_weight=1.5), "yield_weight = 1.5"),
        (dict(target_ms=-1.0), "target_ms = -1.0"),
        (dict(target_ms=math.inf), "target_ms = inf"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(kw, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        rule(**kw)


def test_the_round_trip_the_device_is_away_weighs_rows_against_its_drafting():
    """A session away 58 ms of link plus its drafting (19.5 ms at the floor, 57.7 with the SLM pass: the paper-shape
    phone) at 10 sessions on the flat line: the floor's (1 + 0.9375) / (58 + 19.5 + 10) = 0.0221 tokens per ms of
    round beats every larger tree's at most 2 / (58 + 57.7 + 10) = 0.0159; with the same link and no drafting
    reported, the rows are worth their 10 ms flat step again: r = 20 as on the verifier alone."""
    r = rule()
    r.observe_tree(*chain_tree())
    r.observe_drafting(19.5, 57.7)
    r.observe_away(115.7, CEILING)  # a 33-row round: 57.7 ms of drafting, the rest the link
    assert r.state.link_ms == pytest.approx(58.0)
    np.testing.assert_allclose(r.drafting_ms(np.array([1, 5, 6, 33])), [19.5, 19.5, 57.7, 57.7])
    assert r.allowance(sessions=10) == FLOOR
    assert r.allowance(sessions=1) == CEILING  # one session alone: the whole tree whatever the link
    link_only = rule()
    link_only.observe_tree(*chain_tree())
    link_only.observe_away(58.0, CEILING)
    assert link_only.allowance(sessions=10) == 20
    r.observe_away(float("nan"), 5)  # ignored, as a negative gap is
    r.observe_away(-1.0, 5)
    assert (r.state.aways, r.state.link_ms) == (1, pytest.approx(58.0))
    r.observe_drafting(0.0, 40.0)  # 0: unknown, left out; 40 moves the EMA by its weight 0.1
    assert (r.state.draft_floor_ms, r.state.draft_tree_ms) == (19.5, pytest.approx(57.7 + 0.1 * (40 - 57.7)))


def test_explain_shows_what_the_rule_weighs_and_for_server_builds_the_servers_rule():
    """`explain` lists per candidate r the tokens 1 + V(r), away ms, step ms and tokens per second of round that
    `allowance` maximises (the same numbers as the hand-worked case above: the floor's 1.9375 / (58 + 19.5 + 10)
    ms); `for_server` builds the rule `VerifierServer.allowance_rule` runs: floor and chain_rows K + 1, the
    budget's free rows and its shared state."""
    r = rule()
    r.observe_tree(*chain_tree())
    r.observe_drafting(19.5, 57.7)
    r.observe_away(115.7, CEILING)
    why = r.explain(sessions=10)
    assert why["allowance"] == r.allowance(sessions=10) == FLOOR and why["rows"][0] == FLOOR
    assert why["link_ms"] == pytest.approx(58.0) and why["drafting_ms"] == [19.5, 57.7]
    assert why["tokens"][0] == pytest.approx(1.9375) and why["away_ms"][:2] == pytest.approx([77.5, 115.7])
    assert why["tokens_per_s"][0] == pytest.approx(1e3 * 1.9375 / 87.5)
    assert max(why["tokens_per_s"]) == why["tokens_per_s"][0]
    assert "rows" not in rule().explain(sessions=10)  # nothing learned: no candidates to weigh
    state = BudgetState()
    built = AllowanceRule.for_server(COST, CEILING, 4, target_ms=60.0, budget=state)
    assert (built.floor, built.chain_rows, built.ceiling, built.free_rows) == (5, 5, CEILING, 206)
    assert built.budget is state and built.target_ms == 60.0
    assert AllowanceRule.for_server(COST, 3, 4, floor=2).chain_rows == 3  # K + 1 above the tree: the tree's rows


def test_the_device_measures_its_drafting_per_kind_of_round():
    from hycoc.runtime.drafting_times import DraftingTimes

    t = DraftingTimes(chain_rows=5, weight=0.5)
    assert (t.floor_ms, t.tree_ms) == (0.0, 0.0)  # nothing drafted yet: the OPEN says unknown
    t.observe(5, 2.0)
    t.observe(5, 4.0)  # 2 + 0.5 x (4 - 2)
    t.observe(33, 10.0)
    t.observe(6, float("nan"))  # ignored
    t.observe(33, 1e9)  # clamped to what an OPEN carries: 10 + 0.5 x (60,000 - 10)
    assert (t.floor_ms, t.tree_ms) == (3.0, 10.0 + 0.5 * (60_000 - 10.0))


def test_each_size_class_learns_what_its_rounds_commit_against_what_its_scores_expect():
    """The chain class (rows <= K + 1 = 5) and the tree class learn committed-beyond-the-bonus per token the rank
    values predict for their size. The rank values predict 0.5 + 0.25 + 0.125 + 0.0625 = 0.9375 tokens for 5 rows;
    rounds that commit 3 (2 beyond the bonus) give the chain a yield 2 / 0.9375; a 33-row tree (predicted 1 - 0.5^32)
    that commits 1 (0 beyond) a yield of 0.05, the clamp. V(r) is then the rank values' sum times r's class's yield;
    the budget's value_scale stands in for a class with no round yet. Under load the tree class, with 1 round of
    learn_rounds 16, is explored with the whole tree every 4th grant."""
    r = rule(weight=0.5)
    assert r.yields().tolist() == [1.0, 1.0]  # nothing committed yet: the budget's value_scale
    r.observe_tree(*chain_tree(FLOOR), committed=3)
    r.observe_tree(*chain_tree(FLOOR), committed=3)
    assert r.state.rounds.tolist() == [2, 0]
    np.testing.assert_allclose(r.yields(), [2 / 0.9375, 1.0])
    r.observe_tree(*chain_tree(), committed=1)
    np.testing.assert_allclose(r.yields(), [2 / 0.9375, 0.05])
    # ranks: the 33-row tree's values (EMA 0.5 over the ranks the 5-row trees taught equal values: unchanged)
    np.testing.assert_allclose(r.expected_tokens(np.array([FLOOR, 20])), [2.0, 0.05 * (1 - 0.5**19)])
    # under load the chain's 3 tokens beat every tree: with the scores alone r = 20 won at 10 sessions
    assert r.allowance(sessions=10) == FLOOR
    assert [r.grant(sessions=10) for _ in range(8)] == [FLOOR, FLOOR, FLOOR, CEILING] * 2
    r.observe_tree(*chain_tree(), committed=0)  # a round that committed nothing (none: < 1) teaches no yield
    assert r.state.rounds.tolist() == [2, 1]
    r.observe_tree(*chain_tree(FLOOR), committed=5)  # the third chain round: the running mean of 2, 2, 4
    np.testing.assert_allclose(r.yields()[0], (8 / 3) / 0.9375)


def test_under_load_the_other_class_is_explored_until_it_has_learned():
    """Every explore_every-th grant under load goes to the other class's best r while it has fewer than
    learn_rounds rounds, then every refresh_every-th; at low load every grant is the ceiling and counts nothing."""
    r = rule(learn_rounds=2, explore_every=3, refresh_every=5)
    r.observe_tree(*chain_tree())
    assert [r.grant(sessions=1) for _ in range(4)] == [CEILING] * 4 and r.state.grants == 0
    assert r.allowance(sessions=10) == 20  # the tree class's best; the chain class (floor 5) has no round
    assert [r.grant(sessions=10) for _ in range(6)] == [20, 20, FLOOR, 20, 20, FLOOR]
    r.observe_tree(*chain_tree(FLOOR), committed=1)  # the bonus alone: the chain's yield is the clamp's 0.05
    r.observe_tree(*chain_tree(FLOOR), committed=1)  # 2 rounds: learned; r = 20 still wins; every 5th grant now
    assert [r.grant(sessions=10) for _ in range(9)] == [20, 20, 20, FLOOR, 20, 20, 20, 20, FLOOR]
    off = rule(explore_every=0, refresh_every=0)
    off.observe_tree(*chain_tree())
    assert {off.grant(sessions=10) for _ in range(20)} == {20}
    with pytest.raises(ValueError, match="explore_every = -1"):
        rule(explore_every=-1)
