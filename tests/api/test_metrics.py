"""/metrics and /scaling expose the whole system's signals, named like vLLM's, on one Redis node and on a cluster."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from api.main import create_app
from infra.redis_cluster import LocalCluster
from shared import names
from shared.heartbeat import beat
from shared.settings import Settings
from tests.helpers import in_process_api, submit, until, wait

NAMES = [
    "conveyor:num_requests_waiting", "conveyor:num_requests_running", "conveyor:kv_cache_usage_perc",
    "conveyor:time_to_first_token_seconds", "conveyor:inter_token_latency_seconds",
    "conveyor:e2e_request_latency_seconds", "conveyor:prompt_tokens", "conveyor:generation_tokens",
    "conveyor:stream_lag", "conveyor:stream_pending", "conveyor:workers_live", "conveyor:num_preemptions",
    "conveyor:spec_decode_num_draft_tokens", "conveyor:spec_decode_num_accepted_tokens",
    "conveyor:lora_adapters_resident", "conveyor:lora_loads", "conveyor:lora_evictions",
]


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    fams = text_string_to_metric_families(text)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams for s in f.samples}


def test_metrics_after_a_few_jobs(plumbing_stack) -> None:  # type: ignore[no-untyped-def]
    with httpx.Client(base_url=plumbing_stack.url, timeout=60) as c:
        before = _samples(c.get("/metrics").text)
        for q in ("One", "Two", "Three"):
            assert wait(c, submit(c, prompt=q, max_tokens=8, ignore_eos=True)["id"])["status"] == "succeeded"

        def grown(name: str) -> float:
            return samples.get((name, ()), 0.0) - before.get((name, ()), 0.0)

        def flushed() -> bool:  # workers flush their observations every second; an earlier test's late ones too,
            nonlocal samples  # so every figure asserted below is waited for, not one that others could make up
            samples = _samples(c.get("/metrics").text)
            return (grown("conveyor:inter_token_latency_seconds_count") >= 3 * 7
                    and grown("conveyor:generation_tokens_total") >= 24
                    and grown("conveyor:e2e_request_latency_seconds_count") >= 3)
        samples = before
        until("the workers' observations of the three jobs on /metrics", flushed, timeout=30)
        text = c.get("/metrics").text
    fams = {f.name for f in text_string_to_metric_families(text)}
    for name in NAMES:
        assert name in fams, name
    samples = _samples(text)
    assert grown("conveyor:generation_tokens_total") >= 24
    assert grown("conveyor:prompt_tokens_total") >= 3
    assert grown("conveyor:time_to_first_token_seconds_count") >= 3
    assert grown("conveyor:e2e_request_latency_seconds_count") >= 3
    assert grown("conveyor:inter_token_latency_seconds_count") >= 3 * 7
    assert samples[("conveyor:workers_live", (("pool", "inference"),))] >= 1
    assert samples[("conveyor:workers_live", (("pool", "tokenizer"),))] >= 1
    assert samples[("conveyor:num_requests_waiting", ())] >= 0
    # the fair queue by tenant: these jobs had no key (tenant `_`); each served 8 generated tokens and its prompt
    served = ("conveyor:tenant_served_tokens_total", (("tenant", "_"),))
    assert samples[served] - before.get(served, 0.0) >= 3 * (8 + 1)
    assert samples[("conveyor:tenant_jobs_waiting", (("tenant", "_"),))] >= 0


def test_scaling_counts_what_the_engines_hold(plumbing_stack) -> None:  # type: ignore[no-untyped-def]
    """GET /scaling, read by KEDA's inference trigger: lag plus occupancy, as the local policy counts."""
    import time

    with httpx.Client(base_url=plumbing_stack.url, timeout=60) as c:
        before = c.get("/scaling").json()
        assert set(before) == {"tokenizer", "inference"}
        job = submit(c, prompt="Count to a thousand:", max_tokens=900, ignore_eos=True)
        deadline, seen = time.monotonic() + 30, before["inference"]
        while time.monotonic() < deadline and seen["running"] < 1:
            time.sleep(0.3)  # engines report through their heartbeats (every second here)
            seen = c.get("/scaling").json()["inference"]
        c.post(f"/v1/jobs/{job['id']}/cancel")
    assert seen["running"] >= 1
    assert seen["load"] == seen["lag"] + seen["running"] * 64 / 64  # 64 waiting jobs per replica, MAX_NUM_SEQS 64


async def test_metrics_count_what_waits_and_tell_workers_apart(redis_db: redis.Redis, model_path: str) -> None:
    """On an API in process: jobs that ended (the `ended` stream, without a Celery worker to read it) are not
    waiting; tokenize calls are the tokenizer pool's lag; two inference pods, each pid 1, are two series; the
    tenants past the top ten are one `_other` row in the gauges, none in the served-tokens counter (a sum over a
    changing set would step back)."""
    url = redis_db.connection_pool.connection_kwargs
    settings = Settings(redis_url=f"redis://:{url['password']}@{url['host']}:{url['port']}/{url['db']}",
                        model=model_path)
    for i in range(3):
        redis_db.xadd(names.stream(names.JOBS, 0), {"job_id": f"job_{i}"})
    redis_db.xadd(names.stream(names.TOKENIZE, 0), {"call": "x"})
    for i in range(40):
        redis_db.xadd(names.stream(names.ENDED, 0), {"job_id": f"done_{i}"})
    for host, usage in (("pod-a", 0.9), ("pod-b", 0.1)):
        beat(redis_db, names.INFERENCE_POOL, f"inference-{host}-1-abcdef",
             json.dumps({"pid": 1, "host": host, "kv_cache_usage": usage, "batch_invariant": host == "pod-a"}), 60_000)
    redis_db.zadd(names.fair_key(0, "served_by"), {f"t{i:02}": 100 + i for i in range(12)} | {
        names.SERVED_TOTAL: sum(100 + i for i in range(12))})
    async with in_process_api(settings) as api:
        text = (await api.get("/metrics")).text
    samples = _samples(text)
    served = {dict(labels)["tenant"] for (name, labels) in samples if name == "conveyor:tenant_served_tokens_total"}
    assert served == {f"t{i:02}" for i in range(2, 12)}  # the most served first (none waits)
    assert ("conveyor:tenant_jobs_waiting", (("tenant", "_other"),)) in samples
    assert samples[("conveyor:num_requests_waiting", ())] == 3
    assert samples[("conveyor:pool_lag", (("pool", "tokenizer"),))] == 4
    usage = {labels: v for (name, labels), v in samples.items() if name == "conveyor:kv_cache_usage_perc"}
    assert usage == {(("worker", "inference-pod-a-1-abcdef"),): 0.9, (("worker", "inference-pod-b-1-abcdef"),): 0.1}
    invariant = {labels: v for (name, labels), v in samples.items() if name == "conveyor:batch_invariant"}
    assert invariant == {(("worker", "inference-pod-a-1-abcdef"),): 1, (("worker", "inference-pod-b-1-abcdef"),): 0}


async def test_a_cluster_none_of_whose_nodes_answers_is_a_503(tmp_path: Path, model_path: str) -> None:
    """Every node of the cluster down: the operator's pages and a client's poll answer 503 (retry), not 500."""
    cluster = LocalCluster(tmp_path / "cluster", masters=3, replicas=0)
    url = cluster.start()
    try:
        app = create_app(Settings(redis_url=url, model=model_path))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
                for node in cluster.nodes:  # before the first scrape makes its clients (they ask a node at once)
                    node.stop()
                for path in ("/metrics", "/scaling", f"/v1/jobs/job_{'0' * 32}"):
                    got = await c.get(path)
                    assert got.status_code == 503, (path, got.status_code, got.text)
    finally:
        cluster.stop()


@pytest.mark.slow
async def test_a_scrape_answers_within_prometheus_timeout_while_a_master_is_silent(tmp_path: Path,
                                                                                    model_path: str) -> None:
    """A master paused (no failover yet: a cluster's node timeout is seconds, 5 s on the Kubernetes chart): each of
    the scrape's reads there waits READ_S, retried once, and a scrape makes several. It answers by SCRAPE_S, a 503
    if it must, where before it answered after Prometheus' 10 s scrape timeout (a scrape lost either way)."""
    from api.metrics import SCRAPE_S
    from shared.redis_client import sync_client

    cluster = LocalCluster(tmp_path / "cluster", masters=3, replicas=0, appendfsync="no", node_timeout_ms=60_000)
    url = cluster.start()
    try:
        app = create_app(Settings(redis_url=url, model=model_path))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as c:
                assert (await c.get("/metrics")).status_code == 200
                silent = sync_client(url).get_node_from_key(names.STATS_KEY)  # (the totals' master: read last)
                cluster.kill(silent.port, signal.SIGSTOP)
                try:
                    for path in ("/metrics", "/scaling"):
                        started = time.monotonic()
                        got = await c.get(path)
                        took = time.monotonic() - started
                        assert got.status_code in (200, 503), (path, got.status_code, got.text)
                        assert took < SCRAPE_S + 1.0, (path, took)
                finally:
                    cluster.kill(silent.port, signal.SIGCONT)
    finally:
        cluster.stop()
