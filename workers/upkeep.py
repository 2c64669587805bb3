"""Upkeep that keeps Redis memory flat: trim consumed stream entries, prune consumers gone.

The one owner of stream trimming, run as a Celery beat task (workers/celery_app.py); every function
is safe to run concurrently from many processes. On a cluster a master that does not answer holds back only its
own partitions' upkeep: the others' streams are trimmed all the same (`run`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from shared import names, scripts
from shared.redis_client import CLUSTER_TYPES, RETRYABLE, text


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


CONSUMER_IDLE_MS = 3_600_000  # a consumer that holds nothing and has not read for an hour is a worker gone


def prune_consumers(client: redis.Redis, stream: str, group: str, idle_ms: int = CONSUMER_IDLE_MS) -> int:
    """Remove the group's consumers that hold no entry and have not read for `idle_ms` (prune_consumers.lua)."""
    return int(scripts.PRUNE_CONSUMERS(client, [stream], [group, idle_ms]))


@dataclass
class Pass:
    """One run of the upkeep: entries trimmed per stream, consumers pruned in all, and the partitions whose master
    did not answer (their streams wait for the next run)."""

    trimmed: dict[str, int] = field(default_factory=dict)
    pruned: int = 0
    missed: set[int] = field(default_factory=set)


def run(client: Any, models: Sequence[str] = ("",), idle_ms: int = CONSUMER_IDLE_MS) -> Pass:
    """`trim_consumed` and `prune_consumers` on every stream with a consumer group (each served model's `tokenized`
    streams among them: `models`, their queue names). On a cluster, a master that fails a call is passed over for
    the rest of the run (give `client` a short timeout and no retries: `shared.masters.fail_fast`), its partitions
    counted in `missed`; a single Redis that fails one raises, as every other call would."""
    out = Pass()
    cluster = isinstance(client, CLUSTER_TYPES)
    down: set[str] = set()
    for stream, group in names.stream_groups(models).items():
        node = client.get_node_from_key(stream).name if cluster else ""
        if node in down:
            out.missed.add(names.stream_partition(stream))
            continue
        try:
            out.trimmed[stream] = trim_consumed(client, stream, group)
            out.pruned += prune_consumers(client, stream, group, idle_ms)
        except RETRYABLE:
            if not cluster:
                raise
            down.add(node)
            out.missed.add(names.stream_partition(stream))
    return out
