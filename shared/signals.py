"""Queue signals read from Redis for the autoscaler, /metrics and /scaling: a consumer group's lag and
pending, and the sequences the inference engines hold (from their heartbeats).

Redis 7 reports a group's lag in XINFO GROUPS (the number KEDA's lag mode reads). Redis 6.2 has
no such field, and Redis 7 answers NULL when it cannot tell (after entries in the undelivered range
were deleted or trimmed); then the entries after the group's last-delivered-id are counted, in pages,
by a script inside Redis, so no entry (the inference stream holds binary Arrow batches) crosses the
wire or meets a client that decodes responses (shared/scripts/count_after.lua).
"""

from __future__ import annotations

import redis

from shared import names, scripts
from shared.heartbeat import live_workers
from shared.policy import PoolSignals

PAGE = 200
COUNT_LIMIT = 1_000  # a counted lag stops here: well past where every pool is at its max

POOL_STREAMS: dict[str, tuple[str, str]] = {
    names.TOKENIZER_POOL: (names.JOBS_STREAM, names.TOKENIZER_GROUP),
    names.INFERENCE_POOL: (names.TOKENIZED_STREAM, names.INFERENCE_GROUP),
}


def group_lag(client: redis.Redis, stream: str, group: str, limit: int = COUNT_LIMIT) -> tuple[int, int]:
    """(lag, pending) of `group` on `stream`.

    lag: entries not yet delivered to the group; pending: delivered and not acknowledged. A missing
    stream is (0, 0); a stream without the group is (XLEN, 0), since a group created from the start
    will be handed every entry. A lag that has to be counted (Redis 6.2, or Redis 7's NULL, once the
    group has read something) is exact up to `limit` and reported as `limit` above it.
    """
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError as e:
        if "no such key" in str(e).lower():
            return 0, 0
        raise
    info = next((g for g in groups if _text(g["name"]) == group), None)
    if info is None:
        return int(client.xlen(stream)), 0
    pending = int(info["pending"])
    lag = info.get("lag")
    if lag is not None:
        return int(lag), pending
    return _count_after(client, stream, _text(info["last-delivered-id"]), limit), pending


def pool_lags(client: redis.Redis) -> dict[str, tuple[int, int]]:
    """(lag, pending) for each pool's input stream, by pool name."""
    return {pool: group_lag(client, stream, group) for pool, (stream, group) in POOL_STREAMS.items()}


def pool_signals(client: redis.Redis, capacity_per_replica: int) -> dict[str, PoolSignals]:
    """Each pool's signals for the scaling policy (shared/policy.py), by pool name."""
    lags = pool_lags(client)
    beats = live_workers(client, names.INFERENCE_POOL)
    held = sum(int(b.get("running", 0)) + int(b.get("waiting", 0)) for b in beats)
    lag_t, pend_t = lags[names.TOKENIZER_POOL]
    lag_i, pend_i = lags[names.INFERENCE_POOL]
    return {
        names.TOKENIZER_POOL: PoolSignals(lag=lag_t, pending=pend_t),
        names.INFERENCE_POOL: PoolSignals(lag=lag_i, pending=pend_i, running=held,
                                          capacity_per_replica=capacity_per_replica),
    }


def _count_after(client: redis.Redis, stream: str, last_id: str, limit: int) -> int:
    if last_id == "0-0":  # nothing delivered yet: every entry is lag
        return int(client.xlen(stream))
    return int(scripts.COUNT_AFTER(client, [stream], [f"({last_id}", limit, PAGE]))


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
