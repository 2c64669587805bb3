"""A pool's start-up fault: why its latest worker failed to start (a model whose weights do not load, a missing
model directory), kept in Redis beside the pool's registry (`names.fault_key`) until a worker of the pool starts, or
FAULT_TTL_S after the last failure. A worker that cannot start is restarted with backoff (the supervisor's, or a
pod's CrashLoopBackOff); meanwhile a pool with a fault and no live worker is `unavailable`: the API refuses its
model's new jobs 503 saying so, rather than queue them for a worker that never comes (a pool that scales to zero:
for FROM_ZERO_RETRY_S after each failure, then a job may bring a worker up again), and `/readyz` and
`conveyor status` name the fault. Jobs already queued stay queued: the first worker that starts runs them."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis
import redis.asyncio as aredis

from shared import names
from shared.signals import parse_registry

log = logging.getLogger(__name__)

FAULT_TTL_S = 600  # beyond the longest restart backoff (Kubernetes' CrashLoopBackOff: 300 s)
# a pool that scales to zero starts a worker only for a job that waits: its fault refuses jobs this long after the
# latest failure, no longer, so that once the model is mended a job brings a worker up again
FROM_ZERO_RETRY_S = 60
REASON_MAX = 500  # characters of the error kept


@dataclass(frozen=True)
class Fault:
    reason: str  # the exception's type and message
    at: float  # unix seconds of the latest failure
    failures: int  # failed starts since the fault was first recorded

    def refuses(self, may_be_empty: bool, now: float) -> bool:
        """Whether the pool's new jobs are refused: always while the fault lasts, but for a pool that scales to
        zero (nothing restarts its workers but a job), FROM_ZERO_RETRY_S after the latest failure only."""
        return not may_be_empty or now - self.at < FROM_ZERO_RETRY_S

    @classmethod
    def parse(cls, raw: bytes | str | None) -> Fault | None:
        try:
            data = json.loads(raw) if raw else None
            return cls(str(data["reason"]), float(data["at"]), int(data["failures"])) if isinstance(data, dict) \
                else None
        except (ValueError, KeyError, TypeError):
            return None


def describe(exc: BaseException) -> str:
    """An exception as a fault's reason: its type and message, bounded."""
    text = str(exc) if isinstance(exc, SystemExit) else f"{type(exc).__name__}: {exc}"
    return text[:REASON_MAX]


def report(client: redis.Redis, pool: str, exc: BaseException, context: str = "") -> None:
    """Record that a worker of `pool` failed to start; best effort (a Redis that does not answer is why some
    workers fail: the failure is in their log either way). `context` goes before the error: what was being done."""
    key = names.fault_key(pool)
    try:
        before = Fault.parse(client.get(key))
        failures = (before.failures if before else 0) + 1
        fault = {"reason": (context + describe(exc))[:REASON_MAX], "at": time.time(), "failures": failures}
        client.set(key, json.dumps(fault), ex=FAULT_TTL_S)
    except redis.RedisError as err:
        log.warning("could not record the start-up fault of pool %s: %s", pool, err)


def clear(client: redis.Redis, pool: str) -> None:
    """A worker of `pool` started: whatever fault was recorded is over."""
    client.delete(names.fault_key(pool))


async def unavailable(client: aredis.Redis, pool: str) -> Fault | None:
    """The pool's fault when it has one and no live worker (a worker that runs serves its jobs, whatever another
    failed on), else None; one round trip."""
    pipe = client.pipeline(transaction=False)
    pipe.get(names.fault_key(pool))
    pipe.zrange(names.workers_key(pool), 0, -1, withscores=True)
    raw, registry = await pipe.execute()
    fault = Fault.parse(raw)
    return fault if fault is not None and not parse_registry(registry, time.time()) else None


async def read_faults(client: aredis.Redis, pools: Sequence[str]) -> dict[str, Fault]:
    """The recorded fault of each of `pools` that has one (their keys share a slot: one MGET)."""
    return _by_pool(pools, await client.mget([names.fault_key(p) for p in pools]))


def faults(client: redis.Redis, pools: Sequence[str]) -> dict[str, Fault]:
    """`read_faults`, blocking."""
    return _by_pool(pools, client.mget([names.fault_key(p) for p in pools]))


def _by_pool(pools: Sequence[str], replies: Sequence[bytes | str | None]) -> dict[str, Fault]:
    return {pool: fault for pool, raw in zip(pools, replies) if (fault := Fault.parse(raw)) is not None}
