"""The local autoscaler: every period, read each pool's signals from Redis and ask the policy how many
processes each pool wants. It returns targets; the supervisor applies them (starts and drains
processes), so this module knows nothing of processes."""

from __future__ import annotations

import dataclasses
import logging
import time

from shared import names
from shared.policy import DEFAULT_POLICIES, Decision, PolicyState, PoolPolicy, PoolSignals, desired_replicas
from shared.redis_client import sync_client
from shared.settings import Settings
from shared.signals import lag_per_replica, pool_groups, read_snapshot

log = logging.getLogger("conveyor.autoscaler")
DECISIONS_MAXLEN = 200  # approximate cap of names.SCALING_DECISIONS_STREAM


def policies_for(settings: Settings, bounds: dict[str, tuple[int, int]]) -> dict[str, PoolPolicy]:
    """Each pool's policy, within its (min, max) process count."""
    out = {}
    lag = lag_per_replica(settings)
    for name, (low, high) in bounds.items():
        base = DEFAULT_POLICIES[name if name == names.TOKENIZER_POOL else names.INFERENCE_POOL]  # a model's pool
        out[name] = dataclasses.replace(
            base, min_replicas=low, max_replicas=max(high, 1), lag_per_replica=lag[name],
            scale_in_cooldown_s=settings.scale_in_cooldown_s or base.scale_in_cooldown_s,
            poll_interval_s=settings.autoscale_period_s)
    return out


class Autoscaler:
    def __init__(self, settings: Settings, redis_url: str, bounds: dict[str, tuple[int, int]]) -> None:
        self.client = sync_client(redis_url, decode=False, retries=1)  # stream entries hold binary batches
        self.policies = policies_for(settings, bounds)
        self.states = {name: PolicyState() for name in bounds}
        self.capacity = settings.max_num_seqs
        self.models = settings.model_keys
        self.inference = [names.inference_pool(m) for m in self.models]
        self.period = settings.autoscale_period_s
        self._next = 0.0

    def signals(self) -> dict[str, PoolSignals]:
        """Each pool's signals, read from Redis now."""
        snap = read_snapshot(self.client, self.inference, pool_groups(self.models))
        return snap.pool_signals(self.capacity, self.models)

    def __call__(self, current: dict[str, int]) -> dict[str, int]:
        """Each pool's target given its `current` one: the same until a period has passed, and when
        the signals cannot be read."""
        now = time.monotonic()
        if now < self._next:
            return dict(current)
        self._next = now + self.period
        try:
            signals = self.signals()
        except Exception as exc:  # noqa: BLE001 - the supervisor must outlive any bad reading
            log.warning("no signals this period (%s); pools unchanged", exc)
            return dict(current)
        targets = {}
        for name, now_target in current.items():
            decision = desired_replicas(self.policies[name], signals[name], now_target, now, self.states[name])
            self.states[name] = decision.state
            if decision.replicas != now_target or decision.wanted != now_target:
                log.info("%s: %s", name, decision.reason)
                self.record(name, now_target, decision)
            targets[name] = decision.replicas
        return targets

    def record(self, pool: str, current: int, decision: Decision) -> None:
        """Keep the decision in a capped stream for operators (the dashboard); a failed write is only logged."""
        fields = {"pool": pool, "from": current, "to": decision.replicas, "wanted": decision.wanted,
                  "reason": decision.reason, "at": repr(time.time())}
        try:
            self.client.xadd(names.SCALING_DECISIONS_STREAM, fields, maxlen=DECISIONS_MAXLEN, approximate=True)
        except Exception as exc:  # noqa: BLE001 - the supervisor must outlive any bad write
            log.warning("decision not recorded (%s)", exc)
