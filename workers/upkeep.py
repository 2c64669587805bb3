"""Upkeep that keeps Redis memory flat: trim consumed stream entries.

The one owner of stream trimming, run as a Celery beat task (workers/celery_app.py); every function
is safe to run concurrently from many processes."""

from __future__ import annotations

from collections.abc import Sequence

import redis

from shared import names, scripts
from shared.redis_client import text


def _id_key(eid: str) -> tuple[int, int]:
    ms, _, seq = eid.partition("-")
    return int(ms), int(seq or 0)


def trim_consumed(client: redis.Redis, stream: str, group: str) -> int:
    """Drop entries the group has both been delivered and acknowledged: everything older than
    the oldest pending entry and not after the last-delivered id. Returns entries removed."""
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:
        return 0
    info = next((g for g in groups if text(g["name"]) == group), None)
    if info is None:
        return 0
    floor = text(info["last-delivered-id"])
    if floor == "0-0":
        return 0
    pending = client.xpending(stream, group)
    if pending and pending.get("pending"):
        oldest = text(pending["min"])
        floor = min(floor, oldest, key=_id_key)
    else:
        ms, seq = _id_key(floor)
        floor = f"{ms}-{seq + 1}"  # the last delivered entry is acknowledged too
    return int(client.execute_command("XTRIM", stream, "MINID", floor))


def trim_all(client: redis.Redis, models: Sequence[str] = ("",)) -> dict[str, int]:
    """Trim every stream with a consumer group (each served model's `tokenized` streams among them: `models`,
    their queue names); entries removed, per stream."""
    return {stream: trim_consumed(client, stream, group) for stream, group in names.stream_groups(models).items()}


CONSUMER_IDLE_MS = 3_600_000  # a consumer that holds nothing and has not read for an hour is a worker gone


def prune_consumers(client: redis.Redis, stream: str, group: str, idle_ms: int = CONSUMER_IDLE_MS) -> int:
    """Remove the group's consumers that hold no entry and have not read for `idle_ms` (prune_consumers.lua)."""
    return int(scripts.PRUNE_CONSUMERS(client, [stream], [group, idle_ms]))


def prune_all(client: redis.Redis, models: Sequence[str] = ("",), idle_ms: int = CONSUMER_IDLE_MS) -> int:
    """`prune_consumers` on every stream with a consumer group; how many were removed in all."""
    return sum(prune_consumers(client, stream, group, idle_ms)
               for stream, group in names.stream_groups(models).items())
