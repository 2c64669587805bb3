"""The operator's dashboard.

GET /dashboard: one page (api/static/dashboard.*, no build step; uPlot vendored for the charts).
GET /dashboard/snapshots: a system snapshot about once a second, as server-sent events. One task per
process reads Redis once per tick and every open dashboard gets the same encoded event.
GET /dashboard/jobs/{id}/events: any job's events, for the page's live view when keys are required
(the operator owns no job). GET /dashboard/jobs/{id}/timeline: where its time went, stage by stage, and its
trace's id. With keys required every /dashboard path answers only on the internal port.

A snapshot holds each pool's live workers, lag, pending and held sequences, KV-cache use; the
tokens generated (summed from the inference heartbeats' counters, so it moves while jobs run) and
the jobs ended (request_success_total); TTFT and ITL p50/p99 over the last WINDOW_S seconds (the
difference between the histograms now and WINDOW_S ago); the autoscaler's latest decisions; the
latest jobs. Jobs are followed from every partition's `jobs` and `ended` streams with a blocking
XREAD (the streams are trimmed once consumed, so a periodic read would miss entries; on a cluster,
one non-blocking XREAD per partition, a partition's two streams sharing its slot) and their records
read each tick until they end. Dead letters are summed over the partitions' dead-letter streams.
"""

from __future__ import annotations

import asyncio
import logging
import mimetypes
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any, cast

import orjson
import redis
import redis.asyncio as aredis
from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse
from redis.exceptions import RedisError
from redis.typing import KeyT, StreamIdT

from api import sse
from api.errors import ApiError, error_body, not_found
from api.metrics import _clients
from api.sse import EventStream
from api.streaming import SEQ_MAX, Cut, JobFraming, sse_job_events
from shared import metrics as m
from shared import names
from shared.fair_queue import read_tenants, tenant_rows
from shared.job_ops import tail
from shared.jobs import ACTIVE, STAGE_FIELDS, stages
from shared.policy import pool_load
from shared.redis_client import CLUSTER_TYPES, UNAVAILABLE, aheal
from shared.retry import arun_loop
from shared.settings import Settings
from shared.signals import WorkerBeat, lag_per_replica, pool_groups, read_snapshot

log = logging.getLogger("conveyor.dashboard")
router = APIRouter(prefix="/dashboard", tags=["dashboard"], include_in_schema=False)

STATIC = Path(__file__).resolve().parent / "static"
TICK_S = 1.0
WINDOW_S = 15.0  # latency quantiles cover this many seconds
DECISIONS = 12
ENDED_JOBS = 15
ACTIVE_JOBS = 15  # shown; up to FOLLOWED are followed until they end
FOLLOWED = 100
CLUSTER_IDLE_S = 0.25  # on a cluster, the wait between rounds of reads that found nothing new
ACTIVE_STATUSES = frozenset(s.value for s in ACTIVE)
JOB_FIELDS = ("status", "created_at", "first_token_at", "finished_at", "completion_tokens", "finish_reason")
# an XREAD's reply (None: no new entry), from a decoding client: per stream, its entries (id, fields)
StreamsRead = list[tuple[str, list[tuple[str, dict[str, str]]]]] | None

def quantile(bounds: tuple[float, ...], counts: list[float], q: float) -> float | None:
    """The q-quantile of non-cumulative bucket counts, interpolated in its bucket (as Prometheus'
    histogram_quantile); the highest bound when it falls in the +Inf bucket; None without observations."""
    total = sum(counts)
    if total <= 0:
        return None
    rank, acc = q * total, 0.0
    for i, c in enumerate(counts):
        if c > 0 and acc + c >= rank:
            if i == len(bounds):
                return bounds[-1]
            lower = bounds[i - 1] if i > 0 else 0.0
            return lower + (bounds[i] - lower) * (rank - acc) / c
        acc += c
    return bounds[-1]


class LatencyWindow:
    """A histogram's quantiles over the last `span` seconds, or a little more: the bucket counts now minus those of
    the newest reading at or before the span's start (the oldest there is, while none is that old). Readings far
    apart (ticks that a loaded machine delayed) widen the window rather than leave out what came between them."""

    def __init__(self, name: str, span: float) -> None:
        self.bounds, self.span = m.HISTOGRAMS[name], span
        self.readings: deque[tuple[float, list[float]]] = deque()

    def update(self, now: float, raw: dict[str, str]) -> dict[str, float | None]:
        counts = [float(raw.get(str(i), 0)) for i in range(len(self.bounds) + 1)]
        if self.readings and any(c < p for c, p in zip(counts, self.readings[-1][1])):
            self.readings.clear()  # the histogram was reset (a flushed Redis)
        self.readings.append((now, counts))
        while len(self.readings) > 1 and self.readings[1][0] <= now - self.span:
            self.readings.popleft()
        base = self.readings[0][1]
        window = [c - b for c, b in zip(counts, base)]
        return {"p50": quantile(self.bounds, window, 0.5), "p99": quantile(self.bounds, window, 0.99),
                "n": sum(window)}


class SnapshotReader:
    """Reads one snapshot from Redis (blocking; run it in a thread). Holds what spans ticks: the
    workers' token counters, the latency windows."""

    def __init__(self, client: redis.Redis, raw: redis.Redis, settings: Settings) -> None:
        self.client, self.raw, self.settings = client, raw, settings
        self.worker_tokens: dict[str, int] = {}
        self.tokens = 0
        self.started = False
        self.latency = {"ttft": LatencyWindow(m.TTFT, WINDOW_S), "itl": LatencyWindow(m.ITL, WINDOW_S)}
        self.per_replica = lag_per_replica(settings)

    def read(self, job_ids: list[str]) -> dict[str, Any]:
        now = time.time()
        models = self.settings.model_keys
        inference_pools = names.pools(models)[1:]
        snap = read_snapshot(self.raw, (*names.pools(models), names.CELERY_POOL), pool_groups(models))
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(names.STATS_KEY)
        pipe.hgetall(names.hist_key(m.TTFT))
        pipe.hgetall(names.hist_key(m.ITL))
        pipe.xrevrange(names.SCALING_DECISIONS_STREAM, count=DECISIONS)
        dead_letters = names.streams(names.DEAD)
        for stream in dead_letters:
            pipe.xlen(stream)
        for job_id in job_ids:
            pipe.hmget(names.job_key(job_id), JOB_FIELDS)
        stats, ttft, itl, decisions, *rest = pipe.execute()
        dead, records = sum(rest[:len(dead_letters)]), rest[len(dead_letters):]

        self._count_tokens(tuple(w for pool in inference_pools for w in snap.workers[pool]))
        pools: dict[str, Any] = {}
        for pool, s in snap.pool_signals(self.settings.max_num_seqs, models).items():
            pools[pool] = {"workers": len(snap.workers[pool]), "lag": s.lag, "pending": s.pending,
                           "load": round(float(pool_load(s, self.per_replica[pool])), 2),
                           "lag_per_replica": self.per_replica[pool]}
        for pool in inference_pools:  # each model's pool
            inference = snap.workers[pool]
            kv = [w.kv_cache_usage for w in inference]
            pools[pool].update(running=sum(w.running for w in inference), waiting=sum(w.waiting for w in inference),
                               capacity=self.settings.max_num_seqs * len(inference),
                               kv_cache=sum(kv) / len(kv) if kv else None, kv_cache_max=max(kv, default=None),
                               per_worker=[{"pid": w.pid, "host": w.host, "running": w.running, "waiting": w.waiting,
                                            "kv_cache": w.kv_cache_usage, "steps": w.steps} for w in inference])
        ended = sum(float(v) for k, v in stats.items() if k.startswith(m.REQUEST_SUCCESS + ":"))
        return {
            "at": now,
            "auth_required": self.settings.auth_required,
            "pools": pools,
            "celery_workers": len(snap.workers[names.CELERY_POOL]),
            "totals": {"tokens": self.tokens, "jobs_ended": int(ended),
                       "tokens_of_ended_jobs": int(float(stats.get(m.GENERATION_TOKENS, 0))), "dead_letters": dead},
            "latency": {**{k: w.update(now, raw) for (k, w), raw in zip(self.latency.items(), (ttft, itl))},
                        "window_s": WINDOW_S},
            "decisions": [_decision(fields) for _, fields in decisions],
            "tenants": tenant_rows(read_tenants(self.raw, models=models)),
            "jobs": [_job(job_id, rec) for job_id, rec in zip(job_ids, records)],
        }

    def _count_tokens(self, inference: tuple[WorkerBeat, ...]) -> None:
        """Advance the running total by what each worker generated since the last tick (a worker seen
        for the first time brings all of its count, except on the first tick, which sets the baseline)."""
        seen = {}
        for w in inference:
            count = w.generated_tokens
            before = self.worker_tokens.get(w.worker_id)
            if before is not None and count >= before:
                self.tokens += count - before
            elif self.started:
                self.tokens += count
            seen[w.worker_id] = count
        self.worker_tokens, self.started = seen, True


def _decision(fields: dict[str, str]) -> dict[str, Any]:
    def num(name: str) -> int | None:
        v = fields.get(name, "")
        return int(v) if v.lstrip("-").isdigit() else None

    return {"pool": fields.get("pool", ""), "from": num("from"), "to": num("to"), "wanted": num("wanted"),
            "reason": fields.get("reason", ""), "at": float(fields.get("at") or 0)}


def _job(job_id: str, rec: list[str | None]) -> dict[str, Any] | None:
    status, created, first, finished, tokens, reason = rec
    if status is None:
        return None  # expired
    ttft = float(first) - float(created) if first and created else None
    return {"id": job_id, "status": status, "tokens": int(tokens or 0), "ttft": ttft,
            "created_at": float(created) if created else None, "finished_at": float(finished) if finished else None,
            "finish_reason": reason or None}


class JobFollower:
    """The job ids a snapshot shows: those the `jobs` streams carried (queued, then followed until they
    end) and those the `ended` streams carried (the latest ENDED_JOBS), every partition's, read with a
    blocking XREAD."""

    def __init__(self, client: aredis.Redis) -> None:
        self.client = client
        self.active: OrderedDict[str, None] = OrderedDict()
        self.ended: deque[str] = deque(maxlen=ENDED_JOBS)
        self.jobs_streams = frozenset(names.streams(names.JOBS))
        self.last: dict[KeyT, StreamIdT]  # each stream's last entry id read (as XREAD takes them)
        self.last = dict.fromkeys([*names.streams(names.JOBS), *names.streams(names.ENDED)], "0-0")
        self.cluster = isinstance(client, CLUSTER_TYPES)
        self.seeded = False

    async def step(self) -> None:
        """Seed from the streams' newest entries once, then wait for new entries."""
        if not self.seeded:
            await self.seed()
            self.seeded = True
        await self.read()

    async def seed(self) -> None:
        """The newest entries of each kind: each partition's `count` newest, taken newest first from the
        partitions in turn (their order across partitions is not known) up to `count` in all."""
        for kind, count in ((names.JOBS, FOLLOWED), (names.ENDED, ENDED_JOBS)):
            streams = names.streams(kind)
            replies = await asyncio.gather(*(tail(self.client, stream, count) for stream in streams))
            newest = [got.job_ids for got in replies]
            self.last.update((stream, got.last_id) for stream, got in zip(streams, replies))
            merged = [ids[i] for i in range(count) for ids in newest if i < len(ids)][:count]
            for job_id in reversed(merged):
                self._add(kind, job_id)

    async def read(self) -> None:
        """Wait up to a second for new entries. On a cluster (an XREAD stays in one slot), one round of
        non-blocking reads, a partition's streams each, then a short wait when all were empty."""
        if not self.cluster or names.partition_count() == 1:
            replies = [await self.client.xread(self.last, count=512, block=1000)]
        else:
            pipe = self.client.pipeline(transaction=False)
            for p in names.partitions():
                pipe.xread({s: self.last[s] for s in (names.stream(names.JOBS, p), names.stream(names.ENDED, p))},
                           count=512)
            replies = await pipe.execute()
            if not any(replies):
                await asyncio.sleep(CLUSTER_IDLE_S)
        for reply in cast("list[StreamsRead]", replies):
            for stream, entries in reply or []:
                for entry_id, fields in entries:
                    self.last[stream] = entry_id
                    if "job_id" in fields:
                        self._add(names.JOBS if stream in self.jobs_streams else names.ENDED, fields["job_id"])

    def _add(self, kind: str, job_id: str) -> None:
        """A job id a stream of this kind carried (`names.JOBS` or `names.ENDED`)."""
        if kind == names.JOBS:
            self.active[job_id] = None
            while len(self.active) > FOLLOWED:
                self.active.popitem(last=False)
        elif job_id not in self.ended:
            self.active.pop(job_id, None)
            self.ended.append(job_id)

    def ids(self) -> list[str]:
        return [*reversed(self.active), *reversed(self.ended)]

    def settle(self, jobs: list[dict[str, Any] | None], ids: list[str]) -> list[dict[str, Any]]:
        """Stop following jobs that ended or expired; the jobs to show, active ones first, newest first."""
        shown_active, shown_ended = [], []
        for job_id, job in zip(ids, jobs):
            if job is None:
                self.active.pop(job_id, None)
            elif job["status"] in ACTIVE_STATUSES:
                shown_active.append(job)
            else:
                if job_id in self.active:
                    self._add(names.ENDED, job_id)  # ended before its `ended` entry came
                shown_ended.append(job)
        shown_active.sort(key=lambda j: (j["status"] != "running", -(j["created_at"] or 0)))
        shown_ended.sort(key=lambda j: -(j["finished_at"] or 0))
        return shown_active[:ACTIVE_JOBS] + shown_ended[:ENDED_JOBS]


class SnapshotHub:
    """One reading per tick for every open dashboard of this process. It runs only while a dashboard
    is open: the first subscriber starts it, and it stops a tick after the last one leaves."""

    def __init__(self, state: Any) -> None:
        _clients(state)
        self.reader = SnapshotReader(state.metrics_client, state.metrics_raw, state.settings)
        self.follower = JobFollower(state.redis)
        self.subscribers: set[asyncio.Queue[bytes]] = set()
        self.latest: bytes | None = None
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.idle = asyncio.Event()  # set: no dashboard is open, the loops end

    def subscribe(self) -> asyncio.Queue[bytes]:
        queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=2)
        self.subscribers.add(queue)
        self.idle.clear()
        if self.latest is not None:
            queue.put_nowait(self.latest)
        # each loop ends once no one is subscribed (checked after each of its waits): restart whichever has
        for name, loop in (("follow", self._follow), ("tick", self._tick)):
            task = self.tasks.get(name)
            if task is None or task.done():
                self.tasks[name] = asyncio.create_task(loop(), name=f"dashboard-{name}")
        return queue

    def unsubscribe(self, queue: asyncio.Queue[bytes]) -> None:
        self.subscribers.discard(queue)
        if not self.subscribers:
            self.idle.set()

    async def _follow(self) -> None:
        self.follower.seeded = False
        await arun_loop(self.follower.step, self.idle, log, "dashboard: following jobs",
                        on_outage=lambda: aheal(self.follower.client))

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while self.subscribers:
            ids = self.follower.ids()
            try:
                snap = await asyncio.to_thread(self.reader.read, ids)
                snap["jobs"] = self.follower.settle(snap["jobs"], ids)
                event = sse.encode(orjson.dumps(snap), "snapshot")
            except (RedisError, *UNAVAILABLE) as exc:
                event = sse.encode(orjson.dumps(error_body(503, f"Redis: {exc}")), "error")
            except Exception:  # noqa: BLE001 - a bad reading must not end every dashboard's stream
                log.exception("dashboard snapshot failed")
                event = sse.encode(orjson.dumps(error_body(500, "the snapshot failed; see the API's log")), "error")
            self.latest = event
            for queue in self.subscribers:
                if queue.full():
                    queue.get_nowait()  # a slow reader gets the newest snapshot, not a backlog
                queue.put_nowait(event)
            next_at = max(next_at + TICK_S, loop.time())
            await asyncio.sleep(next_at - loop.time())
        self.latest = None  # stale by the time anyone subscribes again


def _hub(request: Request) -> SnapshotHub:
    state = request.app.state
    if getattr(state, "dashboard", None) is None:
        state.dashboard = SnapshotHub(state)
    return state.dashboard  # type: ignore[no-any-return]


@router.get("")
async def page() -> FileResponse:
    """The dashboard."""
    return FileResponse(STATIC / "dashboard.html", headers={"Cache-Control": "no-cache"})


@router.get("/static/{path:path}")
async def static(path: str) -> FileResponse:
    """The page's script, styles and vendored chart library."""
    file = (STATIC / path).resolve()
    if not file.is_relative_to(STATIC) or not file.is_file():
        raise ApiError(404, f"no file {path!r}")
    media_type = mimetypes.guess_type(file.name)[0] or "application/octet-stream"
    return FileResponse(file, media_type=media_type, headers={"Cache-Control": "no-cache"})


@router.get("/snapshots")
async def snapshots(request: Request) -> EventStream:
    """Server-sent `snapshot` events, one a second (`error` when Redis cannot be read)."""
    hub = _hub(request)

    async def stream() -> AsyncIterator[bytes]:
        queue = hub.subscribe()
        try:
            while True:
                yield await queue.get()
        finally:
            hub.unsubscribe(queue)

    return EventStream(stream(), request.app.state.settings.sse_ping_s)


@router.get("/jobs/{job_id}/timeline")
async def job_timeline(job_id: str, request: Request) -> dict[str, Any]:
    """A job's stages from its record's own times (shared/jobs.py `STAGES`: complete once it has ended), and the
    id of its trace when it is traced (shared/tracing.py)."""
    values = await request.app.state.redis.hmget(names.job_key(job_id), "id", "trace", *STAGE_FIELDS)
    if not values[0]:
        raise not_found(job_id)
    trace = values[1] or ""
    return {"id": job_id, "trace_id": trace.split("-")[1] if trace.count("-") >= 3 else None,
            "stages": stages(dict(zip(STAGE_FIELDS, values[2:])))}


LIVE_VIEW = JobFraming({Cut.EXPIRED: (404, "the job expired"), Cut.STOPPING: (404, "the job expired"),
                        Cut.STORE_DOWN: (503, "the job store is unavailable")})


@router.get("/jobs/{job_id}/events")
async def job_stream(job_id: str, request: Request, after: Annotated[int, Query(ge=0, le=SEQ_MAX)] = 0) -> EventStream:
    """Any job's events (as GET /v1/jobs/{id}/events) for the live view, whoever owns the job."""
    state = request.app.state
    if await state.store.get(job_id) is None:
        raise not_found(job_id)
    return EventStream(sse_job_events(state.store, state.relay, job_id, LIVE_VIEW, after), state.settings.sse_ping_s)

