"""GET /metrics: Prometheus text for the whole system, read from Redis at scrape time.
GET /scaling: each pool's load as the scaling policy counts it (what KEDA's metrics-api trigger reads).

Workers report through Redis (heartbeats with gauges, histogram hashes, counters), so one
scrape of any API process sees every pool. Names follow vLLM's, under `conveyor:`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, cast

import redis
from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from api.errors import ApiError
from shared import metrics as m
from shared import names
from shared.fair_queue import OTHERS, TenantLoad, read_tenants
from shared.policy import pool_load
from shared.redis_client import sync_client
from shared.signals import Snapshot, WorkerBeat, lag_per_replica, pool_groups, read_snapshot

router = APIRouter(tags=["metrics"])
T = TypeVar("T")
READ_S = 3.0  # the operator pages' Redis reads: each is a few commands in one or two round trips
# the most a scrape (/metrics, /scaling) takes: a master that does not answer costs each of its reads READ_S, retried
# once, and a scrape reads several times, so the whole answers a 503 by then, within Prometheus' default scrape
# timeout (10 s), rather than after it (12 s, the scrape lost all the same)
SCRAPE_S = 8.0
WAITING_KINDS = (names.JOBS, names.TOKENIZED)  # the streams whose lag is jobs waiting (not `ended`, not `tokenize`)


class SystemCollector:
    def __init__(self, client: redis.Redis, raw: redis.Redis, relay_streams: int, models: Sequence[str] = ("",),
                 max_num_seqs: int = 64) -> None:
        """`models`: the served models' queue names ('' the default), a pool each."""
        self.client, self.raw, self.relay_streams, self.models = client, raw, relay_streams, models
        self.max_num_seqs = max_num_seqs

    def collect(self) -> Iterator[Metric]:
        groups = names.stream_groups(self.models)
        snap = read_snapshot(self.raw, names.pools(self.models), groups)
        inf = [w for pool in names.pools(self.models)[1:] for w in snap.workers[pool]]
        running = GaugeMetricFamily("conveyor:num_requests_running", "Sequences in engine batches")
        running.add_metric([], sum(w.running for w in inf))
        yield running
        waiting = GaugeMetricFamily("conveyor:num_requests_waiting", "Jobs waiting: in engine queues, in the fair "
                                    "queues and on the `jobs` and `tokenized` streams, not yet delivered")
        queued = sum(lag for stream, (lag, _) in snap.lags.items() if names.stream_kind(stream) in WAITING_KINDS)
        waiting.add_metric([], sum(w.waiting for w in inf) + queued)
        yield waiting
        yield from engine_metrics(inf)
        yield from self._pools(snap, groups)
        dead = GaugeMetricFamily("conveyor:dead_letters", "Entries in the dead-letter streams (every partition's)")
        dead.add_metric([], dead_letters(self.client))
        yield dead
        streams = GaugeMetricFamily("conveyor:sse_streams", "Streams open on this API process")
        streams.add_metric([], self.relay_streams)
        yield streams
        yield from tenant_metrics(read_tenants(self.raw, models=self.models))
        yield from totals(self.client)

    def _pools(self, snap: Snapshot, groups: dict[str, str]) -> Iterator[Metric]:
        """Each pool's live workers, lag and sequences held; each stream's lag and pending entries."""
        live = GaugeMetricFamily("conveyor:workers_live", "Workers with a fresh heartbeat", labels=["pool"])
        for pool in names.pools(self.models):
            live.add_metric([pool], len(snap.workers[pool]))
        yield live
        lag = GaugeMetricFamily("conveyor:pool_lag", "Jobs waiting for the pool (its streams' lag; an inference "
                                "pool's includes its model's fair queue)", labels=["pool"])
        held = GaugeMetricFamily("conveyor:pool_requests_held", "Sequences the pool's engines hold, running or "
                                 "waiting", labels=["pool"])
        for pool, s in snap.pool_signals(self.max_num_seqs, self.models).items():
            lag.add_metric([pool], s.lag)
            if pool != names.TOKENIZER_POOL:
                held.add_metric([pool], s.running)
        yield lag
        yield held
        lag_g = GaugeMetricFamily("conveyor:stream_lag", "Entries not yet delivered to the group",
                                  labels=["stream", "group"])
        pend_g = GaugeMetricFamily("conveyor:stream_pending", "Entries delivered and not yet acknowledged",
                                   labels=["stream", "group"])
        for stream, (behind, pending) in snap.lags.items():
            lag_g.add_metric([stream, groups[stream]], behind)
            pend_g.add_metric([stream, groups[stream]], pending)
        yield lag_g
        yield pend_g


def engine_metrics(inf: list[WorkerBeat]) -> Iterator[Metric]:
    """The inference workers' gauges and counters, by worker: KV cache, preemptions, speculation, LoRA. A worker is
    labelled by its id (pool, host, pid and a random part): a pid alone repeats across pods (each is pid 1)."""
    kv = GaugeMetricFamily("conveyor:kv_cache_usage_perc", "KV-cache usage, 1 = full", labels=["worker"])
    invariant = GaugeMetricFamily("conveyor:batch_invariant", "1 where the worker's engine keeps a seeded request's "
                                  "text whatever shares its steps; 0 where it cannot (README, \"Batch invariance\")",
                                  labels=["worker"])
    for w in inf:
        kv.add_metric([w.worker_id], w.kv_cache_usage)
        invariant.add_metric([w.worker_id], int(w.batch_invariant))
    yield kv
    yield invariant
    pre = CounterMetricFamily("conveyor:num_preemptions", "Sequences preempted (recomputed later), by why: "
                              "KV blocks ran out, a tenant with none running, a better priority",
                              labels=["worker", "reason"])
    for w in inf:
        memory = w.preemptions - w.fair_preemptions - w.priority_preemptions
        for reason, n in (("memory", memory), ("fair_share", w.fair_preemptions),
                          ("priority", w.priority_preemptions)):
            pre.add_metric([w.worker_id, reason], n)
    yield pre
    drafts = CounterMetricFamily("conveyor:spec_decode_num_draft_tokens", "Speculative draft tokens computed "
                                 "(SPECULATIVE=ngram)", labels=["worker"])
    kept = CounterMetricFamily("conveyor:spec_decode_num_accepted_tokens", "Speculative draft tokens kept: "
                               "each a decode step saved", labels=["worker"])
    for w in inf:
        drafts.add_metric([w.worker_id], w.draft_tokens)
        kept.add_metric([w.worker_id], w.accepted_tokens)
    yield drafts
    yield kept
    resident = GaugeMetricFamily("conveyor:lora_adapters_resident", "LoRA adapters resident (MAX_LORAS at most)",
                                 labels=["worker"])
    loads = CounterMetricFamily("conveyor:lora_loads", "LoRA adapters read from their files", labels=["worker"])
    evictions = CounterMetricFamily("conveyor:lora_evictions", "LoRA adapters evicted (least recently used) to "
                                    "make room", labels=["worker"])
    for w in inf:
        resident.add_metric([w.worker_id], w.lora_resident)
        loads.add_metric([w.worker_id], w.lora_loads)
        evictions.add_metric([w.worker_id], w.lora_evictions)
    yield resident
    yield loads
    yield evictions


def totals(r: redis.Redis) -> Iterator[Metric]:
    """Tokens and finished requests since the service began, and the latency histograms. `r`: a decoding client."""
    stats = cast("dict[str, str]", r.hgetall(names.STATS_KEY))
    for name, help_ in ((m.PROMPT_TOKENS, "Prompt tokens processed"),
                        (m.GENERATION_TOKENS, "Tokens generated")):
        c = CounterMetricFamily(name, help_)
        c.add_metric([], float(stats.get(name, 0)))
        yield c
    success = CounterMetricFamily(m.REQUEST_SUCCESS, "Finished requests", labels=["finished_reason"])
    for key, v in stats.items():
        if key.startswith(m.REQUEST_SUCCESS + ":"):
            success.add_metric([key.split(":")[-1]], float(v))
    yield success
    for name in m.HISTOGRAMS:
        buckets, total = m.read_histogram(cast("dict[str, str]", r.hgetall(names.hist_key(name))), name)
        h = HistogramMetricFamily(name, name.split(":")[1].replace("_", " "))
        h.add_metric([], buckets, total)
        yield h


def tenant_metrics(rows: list[TenantLoad]) -> Iterator[Metric]:
    """The fair queue by tenant: the top tenants by name, the rest summed as `_other` in the gauges; `_` is the jobs
    without a key. The served-tokens counter names the top tenants only: each tenant's count only grows, but a sum
    over whoever is not in the top would step back as tenants move in and out of it (Prometheus reads a reset)."""
    waiting = GaugeMetricFamily("conveyor:tenant_jobs_waiting", "Jobs waiting in the fair queue, by tenant",
                                labels=["tenant"])
    oldest = GaugeMetricFamily("conveyor:tenant_oldest_wait_seconds",
                               "How long the tenant's oldest waiting job has waited", labels=["tenant"])
    served = CounterMetricFamily("conveyor:tenant_served_tokens", "Prompt and generated tokens served, by tenant "
                                 "(rate() of it is each tenant's share of service)", labels=["tenant"])
    for row in rows:
        waiting.add_metric([row.tenant], row.waiting)
        oldest.add_metric([row.tenant], row.oldest_wait_s)
        if row.tenant != OTHERS:
            served.add_metric([row.tenant], row.served_tokens)
    yield from (waiting, oldest, served)


def dead_letters(client: redis.Redis) -> int:
    """Entries in the dead-letter streams, summed over the partitions (one XLEN each, in a pipeline)."""
    pipe = client.pipeline(transaction=False)
    for stream in names.streams(names.DEAD):
        pipe.xlen(stream)
    return sum(int(n) for n in pipe.execute())


def _clients(state: Any) -> None:
    """The blocking clients of /metrics, /scaling and the dashboard: a reply waited for READ_S, once retried, so a
    Redis that stopped answering is a 503 within Prometheus' scrape timeout (10 s), not after 20 s."""
    if not hasattr(state, "metrics_client"):
        state.metrics_client = sync_client(state.settings.redis_url, retries=1, timeout=READ_S)
        state.metrics_raw = sync_client(state.settings.redis_url, decode=False, retries=1, timeout=READ_S)


@router.get("/scaling")
async def scaling(request: Request, model: str | None = None) -> dict[str, dict[str, float]]:
    """Each pool's queue signals and its load in lag units (shared/policy.py): the lag of its input
    stream, plus, for inference, the sequences its engines hold as a share of MAX_NUM_SEQS. Wanted
    replicas = ceil(load / lag per replica), the rule of the local autoscaler and of KEDA's
    metrics-api trigger on `inference.load` (infra/k8s/scaledobject-inference.yaml). With several models, each
    has its pool: `inference` the default's, `inference:<name>` another's; `?model=<name>` answers the tokenizer pool
    and that model's alone, as `inference` (so a ScaledObject per model reads `inference.load`)."""
    state = request.app.state
    _clients(state)
    settings = state.settings
    if model is not None and model not in settings.served:
        raise ApiError(404, f"the model '{model}' is not served", type_="invalid_request_error", param="model",
                       code="model_not_found")
    per_replica = lag_per_replica(settings)
    models = settings.model_keys

    def read() -> dict[str, dict[str, float]]:
        snap = read_snapshot(state.metrics_raw, names.pools(models)[1:], pool_groups(models))
        signals = snap.pool_signals(settings.max_num_seqs, models)
        out = {pool: {"lag": s.lag, "pending": s.pending, "running": s.running,
                      "load": float(pool_load(s, per_replica[pool]))} for pool, s in signals.items()}
        if model is None:
            return out
        return {names.TOKENIZER_POOL: out[names.TOKENIZER_POOL],
                names.INFERENCE_POOL: out[names.inference_pool(settings.key_of(model))]}

    return await _within_deadline(read)


async def _within_deadline(read: Callable[[], T]) -> T:
    """`read()` in a thread, answered within SCRAPE_S, else a 503 (the thread ends on its own: each of its reads is
    bounded)."""
    try:
        return await asyncio.wait_for(asyncio.to_thread(read), SCRAPE_S)
    except TimeoutError:
        raise ApiError(503, f"the metrics could not be read within {SCRAPE_S:g} s: a Redis node does not answer; "
                            "retry", headers={"Retry-After": "5"}) from None


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus metrics for the whole system."""
    state = request.app.state
    _clients(state)

    def render() -> bytes:
        registry = CollectorRegistry()
        registry.register(SystemCollector(state.metrics_client, state.metrics_raw, state.relay.active,
                                          state.settings.model_keys, state.settings.max_num_seqs))
        return generate_latest(registry)

    body = await _within_deadline(render)
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")
