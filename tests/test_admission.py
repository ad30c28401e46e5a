"""The admission ledgers (`hycoc.verifier.server.admission`) on their own: the KV budget's invariant (0 <= reserved
<= max_kv_bytes, reserved = the live reservations' sum) is checked where reservations are made, grown, shrunk and
released, so a broken ledger fails at the operation that broke it -- no polling thread sampling it from outside."""

from __future__ import annotations

import numpy as np
import pytest
from hycoc.verifier.server.admission import KvBudget, SessionSlots
from hycoc.verifier.server.errors import KvBudgetExhausted, TooManySessions


def test_random_reserve_grow_shrink_release_keep_the_ledger_equal_to_its_reservations():
    """A model of the ledger (a dict of reservation -> bytes) against KvBudget over 2,000 random operations,
    refusals included: reserved, peak and the refusal count agree after every one."""
    rng = np.random.default_rng(0)
    refused = []
    budget = KvBudget(10_000, 5.0, refused.append)
    held: dict = {}
    peak = 0
    for _ in range(2000):
        op = rng.choice(["reserve", "grow", "shrink", "release"]) if held else "reserve"
        n = int(rng.integers(0, 3000))
        before = sum(held.values())
        if op == "reserve":
            if before + n > budget.capacity:
                with pytest.raises(KvBudgetExhausted):
                    budget.reserve(n, n // 10)
            else:
                held[budget.reserve(n, n // 10)] = n
        else:
            r = list(held)[int(rng.integers(0, len(held)))]
            if op == "grow":
                if before + n > budget.capacity:
                    with pytest.raises(KvBudgetExhausted):
                        r.grow(n, "an APPEND")
                else:
                    assert r.grow(n, "an APPEND") == n
                    held[r] += n
            elif op == "shrink":
                r.shrink(n)
                held[r] -= min(n, held[r])
            else:
                r.release()
                r.release()  # idempotent
                del held[r]
        peak = max(peak, sum(held.values()))
        assert budget.reserved == sum(held.values()) == sum(r.nbytes for r in held)
        assert budget.peak == peak <= budget.capacity
    assert len(refused) > 0 and set(refused) == {"max_kv_bytes"}


def test_a_refused_reservation_changes_nothing_and_names_what_it_needed():
    refused = []
    budget = KvBudget(100, 5.0, refused.append)
    a = budget.reserve(60, 6)
    with pytest.raises(KvBudgetExhausted, match="this request needs 50 KV bytes \\(5 positions\\), 60 of max_kv"):
        budget.reserve(50, 5)
    with pytest.raises(KvBudgetExhausted):
        a.grow(41, "an APPEND of 41 bytes")
    assert budget.reserved == a.nbytes == 60 and refused == ["max_kv_bytes"] * 2


def test_a_broken_ledger_fails_where_the_next_reservation_is_made():
    """Corrupted by hand (what a bug elsewhere would do), the ledger raises at the next reserve, grow or shrink."""
    budget = KvBudget(100, 5.0, lambda kind: None)
    a = budget.reserve(10, 1)
    budget.reserved += 5  # bytes no reservation holds
    with pytest.raises(AssertionError, match="KV ledger broken: reserved = 20.*live reservations hold 15"):
        budget.reserve(5, 1)
    budget = KvBudget(100, 5.0, lambda kind: None)
    a = budget.reserve(10, 1)
    a.nbytes += 1  # a reservation that holds more than the ledger counted
    with pytest.raises(AssertionError, match="KV ledger broken"):
        a.grow(1, "an APPEND")
    with pytest.raises(AssertionError, match="KV ledger broken"):
        a.shrink(1)


def test_session_slots_refuse_past_capacity_and_give_back_once():
    refused = []
    slots = SessionSlots(2, 5.0, refused.append)
    a, b = slots.acquire(), slots.acquire()
    with pytest.raises(TooManySessions, match="2 sessions are open, max_sessions = 2; retry after 5 s"):
        slots.acquire()
    a.release()
    a.release()
    assert slots.in_use == 1 and refused == ["max_sessions"]
    b.release()
    slots.in_use = 2  # corrupted: two slots counted, none held, capacity 2
    with pytest.raises(TooManySessions):
        slots.acquire()
    slots.capacity = 5
    slots.in_use = -1
    with pytest.raises(AssertionError, match="session ledger broken"):
        slots.acquire()
