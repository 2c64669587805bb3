"""GET /metrics: Prometheus text for the whole system, read from Redis at scrape time.
GET /scaling: each pool's load as the scaling policy counts it (what KEDA's metrics-api trigger reads).

Workers report through Redis (heartbeats with gauges, histogram hashes, counters), so one
scrape of any API process sees every pool. Names follow vLLM's, under `conveyor:`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import redis
from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from shared import metrics as m
from shared import names
from shared.heartbeat import live_workers
from shared.policy import pool_load
from shared.redis_client import sync_client
from shared.signals import group_lag, pool_signals

router = APIRouter(tags=["metrics"])


class SystemCollector:
    def __init__(self, client: redis.Redis, raw: redis.Redis, relay_streams: int) -> None:
        self.client, self.raw, self.relay_streams = client, raw, relay_streams

    def collect(self) -> Iterator[Metric]:
        r = self.client
        workers: dict[str, list[dict[str, Any]]] = {}
        for pool in names.POOLS:
            workers[pool] = live_workers(r, pool)
        inf = workers[names.INFERENCE_POOL]
        lags = {stream: group_lag(self.raw, stream, group) for stream, group in names.STREAM_GROUPS.items()}

        running = GaugeMetricFamily("conveyor:num_requests_running", "Sequences in engine batches")
        running.add_metric([], sum(w.get("running", 0) for w in inf))
        yield running
        waiting = GaugeMetricFamily("conveyor:num_requests_waiting",
                                    "Jobs waiting: in engine queues plus stream entries not yet delivered")
        waiting.add_metric([], sum(w.get("waiting", 0) for w in inf) + sum(lag for lag, _ in lags.values()))
        yield waiting
        kv = GaugeMetricFamily("conveyor:kv_cache_usage_perc", "KV-cache usage, 1 = full", labels=["worker"])
        for w in inf:
            kv.add_metric([str(w.get("pid"))], float(w.get("kv_cache_usage", 0.0)))
        yield kv
        live = GaugeMetricFamily("conveyor:workers_live", "Workers with a fresh heartbeat", labels=["pool"])
        for pool, ws in workers.items():
            live.add_metric([pool], len(ws))
        yield live
        lag_g = GaugeMetricFamily("conveyor:stream_lag", "Entries not yet delivered to the group",
                                  labels=["stream", "group"])
        pend_g = GaugeMetricFamily("conveyor:stream_pending", "Entries delivered and not yet acknowledged",
                                   labels=["stream", "group"])
        for stream, (lag, pending) in lags.items():
            lag_g.add_metric([stream, names.STREAM_GROUPS[stream]], lag)
            pend_g.add_metric([stream, names.STREAM_GROUPS[stream]], pending)
        yield lag_g
        yield pend_g
        dead = GaugeMetricFamily("conveyor:dead_letters", "Entries in the dead-letter stream")
        dead.add_metric([], int(r.xlen(names.DEAD_LETTER_STREAM)))
        yield dead
        streams = GaugeMetricFamily("conveyor:sse_streams", "Streams open on this API process")
        streams.add_metric([], self.relay_streams)
        yield streams

        stats = r.hgetall(names.STATS_KEY)
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
            buckets, total = m.read_histogram(r.hgetall(names.hist_key(name)), name)
            h = HistogramMetricFamily(name, name.split(":")[1].replace("_", " "))
            h.add_metric([], buckets, total)
            yield h


def _clients(state: Any) -> None:
    if not hasattr(state, "metrics_client"):
        state.metrics_client = sync_client(state.settings.redis_url, retries=1)
        state.metrics_raw = sync_client(state.settings.redis_url, decode=False, retries=1)


@router.get("/scaling")
async def scaling(request: Request) -> dict[str, dict[str, float]]:
    """Each pool's queue signals and its load in lag units (shared/policy.py): the lag of its input
    stream, plus, for inference, the sequences its engines hold as a share of MAX_NUM_SEQS. Wanted
    replicas = ceil(load / lag per replica), the rule of the local autoscaler and of KEDA's
    metrics-api trigger on `inference.load` (infra/k8s/scaledobject-inference.yaml)."""
    state = request.app.state
    _clients(state)
    settings = state.settings
    per_replica = {names.TOKENIZER_POOL: settings.tokenizer_lag_per_replica,
                   names.INFERENCE_POOL: settings.inference_lag_per_replica}

    def read() -> dict[str, dict[str, float]]:
        signals = pool_signals(state.metrics_raw, settings.max_num_seqs)
        return {pool: {"lag": s.lag, "pending": s.pending, "running": s.running,
                       "load": float(pool_load(s, per_replica[pool]))} for pool, s in signals.items()}

    return await asyncio.to_thread(read)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus metrics for the whole system."""
    state = request.app.state
    _clients(state)

    def render() -> bytes:
        registry = CollectorRegistry()
        registry.register(SystemCollector(state.metrics_client, state.metrics_raw, state.relay.active))  # type: ignore[arg-type]
        return generate_latest(registry)

    body = await asyncio.to_thread(render)
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")
