"""How many replicas a worker pool wants, from its queue signals.

One pure function with the arithmetic of KEDA's `redis-streams` scaler (lag mode) feeding a
Kubernetes HPA, so the local supervisor and a cluster make the same decisions from the same numbers:

- KEDA reports the group's lag as an `AverageValue` metric with target `lagCount`; the HPA wants
  `ceil(load / lag_per_replica)` replicas, clamped to `[min_replicas, max_replicas]`.
- Tolerance: no change while `|load / (lag_per_replica * current) - 1| <= tolerance` (HPA default 0.1).
- Activation: with `lag <= activation_lag` and nothing in flight the pool is idle and goes to
  `min_replicas`, which may be 0 (KEDA scales to zero only then); otherwise it keeps at least one.
- Scale-out is immediate. Scale-in follows the HPA's scale-down stabilization window: the count is
  the highest one wanted during the last `scale_in_cooldown_s`, so a pool shrinks only once the
  cooldown has passed since a higher count was last wanted (KEDA's `cooldownPeriod` for 1 -> 0).

Load. For the tokenizer pool the load is the lag of `jobs` and `tokenize`, plus the entries in work. For the
inference pool it is the lag of `tokenized` (the jobs waiting in the fair queue before it, one each:
shared/fair_queue.py) plus the occupancy of the running batches, expressed in lag units:

    load = lag + max(0, pending - running) + running * lag_per_replica / capacity_per_replica

(`pending - running`: entries taken that no live engine holds, a worker stopped or gone: they wait as lag does) so
that `ceil(load / lag_per_replica) = ceil(lag / lag_per_replica + running / capacity_per_replica)`:
each full batch (`capacity_per_replica` = MAX_NUM_SEQS sequences, running or waiting in an engine)
keeps one replica busy, and the queued lag asks for replicas on top of those. Without this term a
pool whose engines are full but whose stream is drained would shrink under its own running work.
With `capacity_per_replica == 0` (the tokenizer) there is no occupancy term.

The caller keeps the `PolicyState` returned in each `Decision` and passes it to the next call; no
clock is read here (`now` is given, in seconds, from any monotonic source).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from shared import names


@dataclass(frozen=True)
class PoolPolicy:
    """Scaling bounds and targets for one pool; the names in brackets are the cluster's knobs."""

    min_replicas: int  # [ScaledObject minReplicaCount]
    max_replicas: int  # [ScaledObject maxReplicaCount]
    lag_per_replica: int  # target lag per replica [redis-streams lagCount]
    activation_lag: int = 0  # at or below it, with nothing in flight, the pool is idle [activationLagCount]
    tolerance: float = 0.1  # [HPA tolerance]
    scale_in_cooldown_s: float = 300.0  # [HPA scaleDown stabilizationWindowSeconds, KEDA cooldownPeriod]
    poll_interval_s: float = 5.0  # how often the caller decides [KEDA pollingInterval]

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError("need 0 <= min_replicas <= max_replicas and max_replicas >= 1")
        if self.lag_per_replica < 1 or self.activation_lag < 0:
            raise ValueError("need lag_per_replica >= 1 and activation_lag >= 0")
        if self.tolerance < 0 or self.scale_in_cooldown_s < 0 or self.poll_interval_s <= 0:
            raise ValueError("need tolerance >= 0, scale_in_cooldown_s >= 0, poll_interval_s > 0")


@dataclass(frozen=True)
class PoolSignals:
    """What the pool's queue looks like now."""

    lag: int  # entries not yet delivered to the pool's consumer group
    pending: int = 0  # entries delivered to a consumer and not yet acknowledged
    running: int = 0  # sequences the pool's engines hold, running or waiting (inference only)
    capacity_per_replica: int = 0  # sequences one replica holds at most (MAX_NUM_SEQS); 0: no occupancy

    @property
    def in_flight(self) -> bool:
        return self.running > 0 or self.pending > 0


@dataclass(frozen=True)
class PolicyState:
    """Counts wanted during the scale-in window as (time, replicas), oldest first and strictly
    decreasing in replicas, so the first is the highest count wanted in the window. Empty: no
    decision yet (the first call seeds it with the current count, as the HPA does)."""

    window: tuple[tuple[float, int], ...] = ()


@dataclass(frozen=True)
class Decision:
    replicas: int  # what the pool should run now
    wanted: int  # what the signals ask for before the scale-in window holds it back
    reason: str  # one line with the inputs, for the log
    state: PolicyState  # pass to the next call


def pool_load(signals: PoolSignals, lag_per_replica: int) -> Fraction:
    """The pool's load in lag units: lag plus running occupancy (see the module docstring), plus the entries taken
    that no live engine holds (pending past running: a worker stopped, or gone and not yet claimed from): they
    need a worker as a queued job does, and KEDA, which reads only this load, must not scale their pool to zero."""
    load = Fraction(signals.lag) + max(0, signals.pending - signals.running)
    if signals.capacity_per_replica > 0:
        load += Fraction(signals.running * lag_per_replica, signals.capacity_per_replica)
    return load


def desired_replicas(
    policy: PoolPolicy, signals: PoolSignals, current: int, now: float, state: PolicyState
) -> Decision:
    """The replica count for the pool now, and the state to pass next time."""
    load = pool_load(signals, policy.lag_per_replica)
    inputs = (f"lag={signals.lag} pending={signals.pending} running={signals.running} "
              f"load={float(load):.1f} lag_per_replica={policy.lag_per_replica}")
    idle = signals.lag <= policy.activation_lag and not signals.in_flight
    floor = policy.min_replicas if idle else max(policy.min_replicas, 1)

    if idle:
        wanted = policy.min_replicas
        why = f"idle (lag <= activation {policy.activation_lag}, nothing in flight)"
    else:
        wanted = math.ceil(load / policy.lag_per_replica)
        why = f"ceil({float(load):.1f}/{policy.lag_per_replica})={wanted}"
        if current > 0 and abs(load / (policy.lag_per_replica * current) - 1) <= policy.tolerance:
            wanted, why = current, f"{why}, within tolerance {policy.tolerance:g} of {current}"
    if not floor <= wanted <= policy.max_replicas:
        wanted = min(max(wanted, floor), policy.max_replicas)
        why = f"{why}, clamped to [{floor}, {policy.max_replicas}]"

    window = _remember(state.window or ((now, current),), now, wanted, policy.scale_in_cooldown_s)
    highest_at, highest = window[0]
    replicas = wanted if wanted >= current else min(current, highest)
    replicas = min(max(replicas, floor), policy.max_replicas)

    if replicas > current:
        action = f"scale out {current} -> {replicas}"
    elif replicas < current:
        action = f"scale in {current} -> {replicas}"
    elif wanted < current:
        wait = highest_at + policy.scale_in_cooldown_s - now
        action = f"hold {current}: {highest} wanted {now - highest_at:.0f}s ago, scale-in in {wait:.0f}s"
    else:
        action = f"hold {current}"
    return Decision(replicas, wanted, f"{action}; wants {wanted}: {why}; {inputs}", PolicyState(window))


def _remember(
    window: tuple[tuple[float, int], ...], now: float, wanted: int, span: float
) -> tuple[tuple[float, int], ...]:
    """Add a count to the sliding-window maximum and drop what fell out of the window."""
    kept = [(t, n) for t, n in window if t > now - span and n > wanted]
    return (*kept, (now, wanted))


# Local defaults; infra/k8s/scaledobject-*.yaml carry the same numbers (tests/infra/test_keda.py checks).
DEFAULT_POLICIES: dict[str, PoolPolicy] = {
    # A replica per full tokenizer batch of queued jobs (TOKENIZER_BATCH = 64); cheap to start and stop.
    names.TOKENIZER_POOL: PoolPolicy(
        min_replicas=1, max_replicas=8, lag_per_replica=64, activation_lag=0, scale_in_cooldown_s=60.0
    ),
    # The inference lag is jobs waiting in the fair queue (and entries not yet read), one each: a replica per
    # MAX_NUM_SEQS (64) of them on top of one per full batch; a replica loads a model.
    names.INFERENCE_POOL: PoolPolicy(
        min_replicas=1, max_replicas=4, lag_per_replica=64, activation_lag=0, scale_in_cooldown_s=300.0
    ),
}
