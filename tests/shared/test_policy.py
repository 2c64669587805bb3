"""The scaling policy: KEDA redis-streams (lag mode) + HPA arithmetic, decided without clocks or Redis."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest

from shared import names
from shared.policy import (
    DEFAULT_POLICIES,
    Decision,
    PolicyState,
    PoolPolicy,
    PoolSignals,
    desired_replicas,
    pool_load,
)

POLICY = PoolPolicy(min_replicas=1, max_replicas=20, lag_per_replica=5, scale_in_cooldown_s=300)
ZERO = replace(POLICY, min_replicas=0, activation_lag=3)
INFER = PoolPolicy(min_replicas=1, max_replicas=8, lag_per_replica=2, scale_in_cooldown_s=300)


def decide(policy: PoolPolicy, signals: PoolSignals, current: int, now: float = 0.0,
           state: PolicyState | None = None) -> Decision:
    return desired_replicas(policy, signals, current, now, state or PolicyState())


@pytest.mark.parametrize(
    ("policy", "signals", "current", "expected"),
    [
        # KEDA's AverageValue arithmetic: lag 50 at lagCount 5 wants 10 replicas
        (POLICY, PoolSignals(lag=50), 1, 10),
        (POLICY, PoolSignals(lag=51), 1, 11),
        (POLICY, PoolSignals(lag=1), 0, 1),
        # clamps
        (POLICY, PoolSignals(lag=5000), 3, 20),
        (POLICY, PoolSignals(lag=50), 25, 20),
        (replace(POLICY, min_replicas=3), PoolSignals(lag=1), 3, 3),
        (replace(POLICY, min_replicas=3), PoolSignals(lag=0), 0, 3),
        # activation, min 0: idle stays at zero, lag past activation wakes the pool
        (ZERO, PoolSignals(lag=0), 0, 0),
        (ZERO, PoolSignals(lag=3), 0, 0),
        (ZERO, PoolSignals(lag=4), 0, 1),
        (ZERO, PoolSignals(lag=12), 0, 3),
        # work in flight is not idle, even with no lag
        (ZERO, PoolSignals(lag=0, pending=1), 0, 1),
        (ZERO, PoolSignals(lag=0, running=2, capacity_per_replica=64), 0, 1),
        # tolerance band around the current count (|ratio - 1| <= 0.1 holds)
        (POLICY, PoolSignals(lag=52), 10, 10),
        (POLICY, PoolSignals(lag=55), 10, 10),
        (POLICY, PoolSignals(lag=56), 10, 12),
        # inference: running sequences are load; a full batch of capacity_per_replica is one replica
        (INFER, PoolSignals(lag=0, running=128, capacity_per_replica=64), 2, 2),
        (INFER, PoolSignals(lag=4, running=128, capacity_per_replica=64), 2, 4),
        (INFER, PoolSignals(lag=0, running=129, capacity_per_replica=64), 1, 3),
        (INFER, PoolSignals(lag=1, running=0, capacity_per_replica=64), 1, 1),
        # without a capacity (the tokenizer pool) running adds nothing
        (POLICY, PoolSignals(lag=10, running=1000), 1, 2),
    ],
)
def test_one_decision(policy: PoolPolicy, signals: PoolSignals, current: int, expected: int) -> None:
    decision = decide(policy, signals, current)
    assert decision.replicas == expected, decision.reason


def test_reason_names_the_inputs() -> None:
    d = decide(POLICY, PoolSignals(lag=46, pending=4), 1)  # 4 taken and held by no live engine: load as lag
    assert d.reason.startswith("scale out 1 -> 10")
    for part in ("lag=46", "pending=4", "running=0", "load=50.0", "lag_per_replica=5", "ceil(50.0/5)=10"):
        assert part in d.reason
    assert "clamped to [1, 20]" in decide(POLICY, PoolSignals(lag=500), 1).reason
    assert "tolerance" in decide(POLICY, PoolSignals(lag=52), 10).reason
    assert "idle" in decide(ZERO, PoolSignals(lag=0), 0).reason


def run(policy: PoolPolicy, steps: Sequence[tuple[float, int]], current: int) -> list[int]:
    """Feed (time, lag) steps through the policy, applying each decision; return the counts."""
    state, counts = PolicyState(), []
    for now, lag in steps:
        d = desired_replicas(policy, PoolSignals(lag=lag), current, now, state)
        state, current = d.state, d.replicas
        counts.append(current)
    return counts


def test_scale_out_is_immediate() -> None:
    assert run(POLICY, [(0, 5), (5, 50), (10, 100)], current=1) == [1, 10, 20]


def test_no_scale_in_before_the_cooldown_then_scale_in() -> None:
    steps = [(0, 50), (5, 0), (150, 0), (299, 0), (300, 0), (301, 0)]
    assert run(POLICY, steps, current=1) == [10, 10, 10, 10, 1, 1]


def test_cooldown_counts_from_the_last_time_more_was_wanted() -> None:
    steps = [(0, 50), (200, 50), (210, 0), (499, 0), (500, 0)]
    assert run(POLICY, steps, current=10) == [10, 10, 10, 10, 1]


def test_scale_in_steps_down_to_the_highest_count_wanted_in_the_window() -> None:
    # the HPA's stabilization: 10 wanted at 0, 5 at 100, then 1; the window is 300 s
    steps = [(0, 50), (100, 25), (200, 0), (301, 0), (401, 0), (501, 0)]
    assert run(POLICY, steps, current=10) == [10, 10, 10, 5, 1, 1]


def test_scale_out_during_a_cooldown_is_not_held() -> None:
    steps = [(0, 50), (10, 0), (20, 100)]
    assert run(POLICY, steps, current=1) == [10, 10, 20]


def test_first_decision_holds_the_starting_count_for_a_cooldown() -> None:
    assert run(POLICY, [(0, 0), (299, 0), (301, 0)], current=4) == [4, 4, 1]


def test_scale_to_zero_waits_for_the_cooldown() -> None:
    counts = run(ZERO, [(0, 20), (10, 0), (299, 0), (310, 0)], current=0)
    assert counts == [4, 4, 4, 0]


def test_no_flapping_inside_the_tolerance_band() -> None:
    steps = [(t * 5.0, 48 if t % 2 else 53) for t in range(200)]
    assert set(run(POLICY, steps, current=10)) == {10}


def test_no_flapping_when_load_swings_faster_than_the_cooldown() -> None:
    steps = [(t * 30.0, 100 if t % 2 else 10) for t in range(40)]
    assert set(run(POLICY, steps, current=1)[1:]) == {20}


def test_hold_reason_says_when_scale_in_comes() -> None:
    first = decide(POLICY, PoolSignals(lag=50), 10, now=0)
    held = decide(POLICY, PoolSignals(lag=0), 10, now=100, state=first.state)
    assert (held.replicas, held.wanted) == (10, 1)
    assert held.reason.startswith("hold 10: 10 wanted 100s ago, scale-in in 200s")


def test_state_stays_small() -> None:
    state, current = PolicyState(), 1
    for t in range(1000):
        d = desired_replicas(POLICY, PoolSignals(lag=(t * 37) % 101), current, t * 5.0, state)
        state, current = d.state, d.replicas
    assert len(state.window) <= POLICY.max_replicas + 1


def test_pure() -> None:
    state = decide(POLICY, PoolSignals(lag=50), 1).state
    a = desired_replicas(POLICY, PoolSignals(lag=0), 10, 50.0, state)
    b = desired_replicas(POLICY, PoolSignals(lag=0), 10, 50.0, state)
    assert a == b


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_replicas": 3, "max_replicas": 2, "lag_per_replica": 5},
        {"min_replicas": 0, "max_replicas": 0, "lag_per_replica": 5},
        {"min_replicas": -1, "max_replicas": 2, "lag_per_replica": 5},
        {"min_replicas": 1, "max_replicas": 2, "lag_per_replica": 0},
        {"min_replicas": 1, "max_replicas": 2, "lag_per_replica": 5, "activation_lag": -1},
        {"min_replicas": 1, "max_replicas": 2, "lag_per_replica": 5, "tolerance": -0.1},
        {"min_replicas": 1, "max_replicas": 2, "lag_per_replica": 5, "poll_interval_s": 0},
    ],
)
def test_policy_rejects_nonsense(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        PoolPolicy(**kwargs)  # type: ignore[arg-type]


def test_defaults_cover_every_pool() -> None:
    assert set(DEFAULT_POLICIES) == set(names.POOLS)


def test_an_entry_no_live_engine_holds_is_load() -> None:
    """What KEDA reads (`load`, /scaling): a job taken by a worker that stopped or died, held by no live engine
    (pending past running), is load, so its pool at zero's minimum is not scaled to zero under it."""
    assert pool_load(PoolSignals(lag=0, pending=1, running=0, capacity_per_replica=64), 64) == 1
    assert pool_load(PoolSignals(lag=0, pending=1, running=1, capacity_per_replica=64), 64) == 1  # held: occupancy
    assert pool_load(PoolSignals(lag=2, pending=0), 8) == 2
