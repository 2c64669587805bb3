"""The one reader of the signals that /metrics, /scaling, /readyz, the dashboard, `conveyor status`, the
autoscaler and the stream consumers' claims go by: which workers are live, what their heartbeats hold,
and each consumer group's lag and pending (the inference group's lag counts the jobs waiting in the fair
queue before its stream).

A worker is live while its pool's registry (`names.workers_key`) scores it later than now: the score
is when its heartbeat runs out (shared/heartbeat.py writes both). `is_live` is the only such test.

Redis 7 reports a group's lag in XINFO GROUPS. Redis 6.2 has
no such field, and Redis 7 answers NULL when it cannot tell (after entries in the undelivered range
were deleted or trimmed); then the entries after the group's last-delivered-id are counted, in pages,
by a script inside Redis, so no entry (the inference stream holds binary Arrow batches) crosses the
wire or meets a client that decodes responses (shared/scripts/count_after.lua).

The `parse_*` functions turn Redis replies into typed values; the fetchers only queue the commands
and run them: `read_snapshot` and `read_live` (sync), `aread_live` (asyncio).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import redis
import redis.asyncio as aredis

from shared import names, scripts
from shared.job_ops import queue_count_after
from shared.policy import PoolSignals
from shared.redis_client import text
from shared.settings import Settings

PAGE = 200
COUNT_LIMIT = 1_000  # a counted lag stops here: well past where every pool is at its max
WATCHED_POOLS = (*names.POOLS, names.CELERY_POOL)  # the pools a snapshot lists unless told otherwise


def pool_streams(models: Sequence[str] = ("",)) -> dict[str, tuple[list[str], str]]:
    """Each scaled pool of a deployment serving `models` (their queue names, '' the default) -> (the streams it
    reads, every partition's, and its group): the tokenizer pool reads `jobs` and `tokenize` (the /tokenize and
    count_tokens calls), each model's pool its `tokenized`."""
    out = {names.TOKENIZER_POOL: (names.streams(names.JOBS) + names.streams(names.TOKENIZE), names.TOKENIZER_GROUP)}
    for model in models:
        out[names.inference_pool(model)] = (names.streams(names.TOKENIZED, model), names.INFERENCE_GROUP)
    return out


POOL_STREAMS = pool_streams()  # a one-model deployment's


def pool_groups(models: Sequence[str] = ("",)) -> dict[str, str]:
    """{stream: group} of `pool_streams`: the lags that `Snapshot.pool_signals` needs."""
    return {stream: group for streams, group in pool_streams(models).values() for stream in streams}


POOL_GROUPS = pool_groups()


def fair_payloads(stream: str) -> str | None:
    """A `tokenized` stream's lag includes the jobs waiting in its fair queue (shared/fair_queue.py), counted by
    their payloads: the hash that holds them (None for a stream of another kind)."""
    if names.stream_kind(stream) != names.TOKENIZED:
        return None
    return names.fair_key(names.stream_partition(stream), "payload", names.stream_model(stream))


class GroupLag(NamedTuple):
    """A consumer group's lag (entries not yet delivered to it) and pending (delivered, not acknowledged)."""

    lag: int
    pending: int


class Uncounted(NamedTuple):
    """A group whose lag Redis did not report: the entries after `last_id` are its lag."""

    last_id: str
    pending: int


@dataclass(frozen=True)
class WorkerBeat:
    """A live worker and the gauges its heartbeat holds (zeros where it holds none)."""

    pool: str
    worker_id: str
    pid: int | None = None
    host: str = ""
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    steps: int = 0
    generated_tokens: int = 0
    preemptions: int = 0  # since the worker started: all, and of those for fair share, for priority
    fair_preemptions: int = 0
    priority_preemptions: int = 0
    draft_tokens: int = 0  # since the worker started: speculative draft tokens computed, and of those kept
    accepted_tokens: int = 0
    lora_resident: int = 0  # LoRA adapters resident now; loaded and evicted since the worker started
    lora_loads: int = 0
    lora_evictions: int = 0
    # its engine keeps a seeded request's text whatever shares its steps; only a body that says false says otherwise
    batch_invariant: bool = True

    @property
    def held(self) -> int:
        """Sequences its engine holds, running or waiting."""
        return self.running + self.waiting


@dataclass(frozen=True)
class Snapshot:
    """Live workers by pool (sorted by id) and group lags by stream, read at `at` (unix seconds)."""

    at: float
    workers: Mapping[str, tuple[WorkerBeat, ...]]
    lags: Mapping[str, GroupLag]

    def pool_signals(self, capacity_per_replica: int, models: Sequence[str] = ("",)) -> dict[str, PoolSignals]:
        """Each scaled pool's signals for the policy (shared/policy.py), by pool name: its input
        stream's lag and pending, plus, for inference, the sequences its engines hold. Needs the
        lags of `pool_groups(models)` and, for `running`, the inference pools' workers."""
        out = {}
        for pool, (streams, _group) in pool_streams(models).items():  # summed over the partitions
            lag = sum(self.lags[stream].lag for stream in streams)
            pending = sum(self.lags[stream].pending for stream in streams)
            if pool != names.TOKENIZER_POOL:
                held = sum(w.held for w in self.workers.get(pool, ()))
                out[pool] = PoolSignals(lag, pending, held, capacity_per_replica)
            else:
                out[pool] = PoolSignals(lag, pending)
        return out


def is_live(expires_at: float | None, now: float) -> bool:
    """Whether a worker whose registry score is `expires_at` (None: not in the registry) is live at `now`."""
    return expires_at is not None and expires_at > now


def lag_per_replica(settings: Settings) -> dict[str, int]:
    """Each scaled pool's target lag per replica (the policy's, and KEDA's lagCount), by pool name."""
    return {names.TOKENIZER_POOL: settings.tokenizer_lag_per_replica,
            **{names.inference_pool(m): settings.inference_lag_per_replica for m in settings.model_keys}}


def parse_registry(reply: Iterable[tuple[bytes | str, float]], now: float) -> tuple[str, ...]:
    """The live ids, sorted, in a ZRANGE ... WITHSCORES reply of a pool's registry."""
    return tuple(sorted(text(member) for member, score in reply if is_live(float(score), now)))


def parse_beat(pool: str, worker_id: str, body: bytes | str | None) -> WorkerBeat:
    """A worker's heartbeat body as typed gauges; a missing body, or one that is not a JSON object
    (the Celery workers' is "1"), holds none."""
    try:
        data = json.loads(body) if body else {}
    except ValueError:
        data = {}
    if not isinstance(data, dict):
        data = {}
    pid = data.get("pid")
    return WorkerBeat(pool, worker_id, pid if isinstance(pid, int) else None, str(data.get("host", "")),
                      running=int(_number(data, "running")), waiting=int(_number(data, "waiting")),
                      kv_cache_usage=float(_number(data, "kv_cache_usage")), steps=int(_number(data, "steps")),
                      generated_tokens=int(_number(data, "generated_tokens")),
                      preemptions=int(_number(data, "preemptions")),
                      fair_preemptions=int(_number(data, "fair_preemptions")),
                      priority_preemptions=int(_number(data, "priority_preemptions")),
                      draft_tokens=int(_number(data, "draft_tokens")),
                      accepted_tokens=int(_number(data, "accepted_tokens")),
                      lora_resident=int(_number(data, "lora_resident")), lora_loads=int(_number(data, "lora_loads")),
                      lora_evictions=int(_number(data, "lora_evictions")),
                      batch_invariant=data.get("batch_invariant") is not False)


def parse_group(groups: list[dict[str, Any]] | Exception, length: int, group: str) -> GroupLag | Uncounted:
    """`group`'s lag and pending from its stream's XINFO GROUPS and XLEN replies. A missing stream is
    (0, 0); a stream without the group is (XLEN, 0), since a group created from the start will be
    handed every entry; a lag Redis does not report is Uncounted, unless nothing was delivered yet."""
    if isinstance(groups, Exception):
        if isinstance(groups, redis.ResponseError) and "no such key" in str(groups).lower():
            return GroupLag(0, 0)
        raise groups
    info = next((g for g in groups if text(g["name"]) == group), None)
    if info is None:
        return GroupLag(int(length), 0)
    pending = int(info["pending"])
    lag = info.get("lag")
    if lag is not None:
        return GroupLag(int(lag), pending)
    last_id = text(info["last-delivered-id"])
    if last_id == "0-0":  # nothing delivered yet: every entry is lag
        return GroupLag(int(length), pending)
    return Uncounted(last_id, pending)


def read_live(client: redis.Redis, pools: Sequence[str] = WATCHED_POOLS) -> dict[str, tuple[str, ...]]:
    """The live worker ids of each of `pools`, in one round trip."""
    now = time.time()
    pipe = client.pipeline(transaction=False)
    _queue_registries(pipe, pools)
    return _live_by_pool(pools, pipe.execute(), now)


async def aread_live(client: aredis.Redis, pools: Sequence[str] = WATCHED_POOLS) -> dict[str, tuple[str, ...]]:
    """`read_live` for asyncio."""
    now = time.time()
    pipe = client.pipeline(transaction=False)
    _queue_registries(pipe, pools)
    return _live_by_pool(pools, await pipe.execute(), now)


def read_snapshot(client: redis.Redis, pools: Sequence[str] = WATCHED_POOLS,
                  streams: Mapping[str, str] | None = None, limit: int = COUNT_LIMIT) -> Snapshot:
    """The live workers of `pools` with their heartbeats, and the lag of each group of `streams`
    ({stream: group}), in two round trips. A lag that has to be counted is exact up to `limit` and
    reported as `limit` above it. Either a decoding client or a raw one will do. `streams`: the default model's
    (`names.stream_groups()`) unless given."""
    streams = names.stream_groups() if streams is None else streams
    now = time.time()
    pipe = client.pipeline(transaction=False)
    _queue_registries(pipe, pools)
    for stream in streams:
        pipe.xinfo_groups(stream)
        pipe.xlen(stream)
    payloads = {stream: key for stream in streams if (key := fair_payloads(stream)) is not None}
    waiting = list(payloads)
    for stream in waiting:
        pipe.hlen(payloads[stream])
    first = pipe.execute(raise_on_error=False)
    live = _live_by_pool(pools, first[:len(pools)], now)
    info = first[len(pools):len(pools) + 2 * len(streams)]
    in_fair_queue = dict(zip(waiting, (int(_ok(n)) for n in first[len(pools) + 2 * len(streams):])))
    # XLEN fails only where XINFO GROUPS does (a key of another type), and parse_group raises that
    groups = {stream: parse_group(info[2 * i], info[2 * i + 1], group)
              for i, (stream, group) in enumerate(streams.items())}

    ids = [(pool, worker) for pool in pools for worker in live[pool]]
    uncounted = {stream: g for stream, g in groups.items() if isinstance(g, Uncounted)}
    pipe = client.pipeline(transaction=False)
    if ids:
        pipe.execute_command("MGET", *[names.heartbeat_key(pool, worker) for pool, worker in ids])  # one slot
    for stream, g in uncounted.items():
        queue_count_after(pipe, stream, g.last_id, limit, PAGE)
    second = iter(scripts.execute(pipe) if ids or uncounted else [])
    bodies = next(second) if ids else []

    workers: dict[str, list[WorkerBeat]] = {pool: [] for pool in pools}
    for (pool, worker), body in zip(ids, bodies):
        workers[pool].append(parse_beat(pool, worker, body))
    lags = {stream: GroupLag(int(next(second)), g.pending) if isinstance(g, Uncounted) else g
            for stream, g in groups.items()}
    lags = {stream: GroupLag(g.lag + in_fair_queue.get(stream, 0), g.pending) for stream, g in lags.items()}
    return Snapshot(now, {pool: tuple(ws) for pool, ws in workers.items()}, lags)


def _queue_registries(pipe: redis.client.Pipeline | aredis.client.Pipeline, pools: Sequence[str]) -> None:
    for pool in pools:
        pipe.zrange(names.workers_key(pool), 0, -1, withscores=True)


def _live_by_pool(pools: Sequence[str], replies: list[Any], now: float) -> dict[str, tuple[str, ...]]:
    return {pool: parse_registry(_ok(reply), now) for pool, reply in zip(pools, replies)}


def _ok(reply: Any) -> Any:
    """A pipeline reply, raised when it is an error."""
    if isinstance(reply, Exception):
        raise reply
    return reply


def _number(data: dict[str, Any], key: str) -> float:
    value = data.get(key, 0)
    return value if isinstance(value, int | float) and not isinstance(value, bool) else 0
