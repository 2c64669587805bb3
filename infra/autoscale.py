"""The local autoscaler: every period, read each pool's signals from Redis, ask the policy how
many processes it wants, and set the pool's target. The supervisor starts and drains processes."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from shared import names
from shared.policy import DEFAULT_POLICIES, Decision, PolicyState, PoolPolicy, PoolSignals, desired_replicas
from shared.redis_client import sync_client
from shared.settings import Settings
from shared.signals import pool_signals

if TYPE_CHECKING:
    from infra.supervisor import Pool

log = logging.getLogger("conveyor.autoscaler")
DECISIONS_MAXLEN = 200  # approximate cap of names.SCALING_DECISIONS_STREAM


def policies_for(settings: Settings, pools: dict[str, Pool]) -> dict[str, PoolPolicy]:
    out = {}
    lag = {names.TOKENIZER_POOL: settings.tokenizer_lag_per_replica,
           names.INFERENCE_POOL: settings.inference_lag_per_replica}
    for name, pool in pools.items():
        base = DEFAULT_POLICIES[name]
        out[name] = dataclasses.replace(
            base, min_replicas=pool.min_size, max_replicas=max(pool.max_size, 1), lag_per_replica=lag[name],
            scale_in_cooldown_s=settings.scale_in_cooldown_s or base.scale_in_cooldown_s,
            poll_interval_s=settings.autoscale_period_s)
    return out


class Autoscaler:
    def __init__(self, settings: Settings, redis_url: str, pools: dict[str, Pool]) -> None:
        self.client = sync_client(redis_url, decode=False, retries=1)  # stream entries hold binary batches
        self.pools = pools
        self.policies = policies_for(settings, pools)
        self.states = {name: PolicyState() for name in pools}
        self.capacity = settings.max_num_seqs
        self.period = settings.autoscale_period_s
        self._next = 0.0

    def signals(self) -> dict[str, PoolSignals]:
        return pool_signals(self.client, self.capacity)

    def __call__(self) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.period
        try:
            signals = self.signals()
        except Exception as exc:  # noqa: BLE001 - the supervisor must outlive any bad reading
            log.warning("no signals this period (%s); pools unchanged", exc)
            return
        for name, pool in self.pools.items():
            decision = desired_replicas(self.policies[name], signals[name], pool.target, now, self.states[name])
            self.states[name] = decision.state
            if decision.replicas != pool.target or decision.wanted != pool.target:
                log.info("%s: %s", name, decision.reason)
                self.record(name, pool.target, decision)
            pool.target = decision.replicas

    def record(self, pool: str, current: int, decision: Decision) -> None:
        """Keep the decision in a capped stream for operators (the dashboard); a failed write is only logged."""
        fields = {"pool": pool, "from": current, "to": decision.replicas, "wanted": decision.wanted,
                  "reason": decision.reason, "at": repr(time.time())}
        try:
            self.client.xadd(names.SCALING_DECISIONS_STREAM, fields, maxlen=DECISIONS_MAXLEN, approximate=True)
        except Exception as exc:  # noqa: BLE001 - the supervisor must outlive any bad write
            log.warning("decision not recorded (%s)", exc)
