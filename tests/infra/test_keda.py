"""KEDA's ScaledObjects ask for the replica counts the local autoscaler (shared/policy.py) would, from the same
signals and within the same bounds, and their HPA behaviour and authentication match. The signals come from the
API's GET /scaling, which sums every partition's lag (shared/signals.py POOL_STREAMS), as the local autoscaler
does: a redis-streams trigger reads one stream, i.e. one partition of REDIS_PARTITIONS."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import redis

from infra.redis_server import RedisServer
from shared import names
from shared.policy import PolicyState, PoolSignals, desired_replicas, pool_load
from shared.signals import POOL_STREAMS
from tests.infra.cluster_model import keda_wants, local_policies
from tests.infra.deploy_files import (
    KUBERNETES_VERSION,
    ROOT,
    container,
    kinds_in,
    of_kind,
    service_backend,
    with_redis_cluster,
    workloads,
)
from tests.infra.deploy_processes import SETTINGS_ENV, api_serves, cluster_settings, container_env

# GET /scaling as the API serves it, in a process of its own: REDIS_PARTITIONS is read once, at import
SCALING = """
import json
from fastapi import FastAPI
from fastapi.testclient import TestClient
from api.metrics import router
from shared.settings import Settings
app = FastAPI()
app.include_router(router)
app.state.settings = Settings()
with TestClient(app) as client:
    reply = client.get("/scaling")
    assert reply.status_code == 200, reply.text
    print(json.dumps(reply.json()))
"""


def cluster_partitions() -> int:
    """REDIS_PARTITIONS with the Redis Cluster component (infra/k8s/redis-cluster)."""
    return int(kinds_in(with_redis_cluster(), "ConfigMap")["conveyor"]["data"]["REDIS_PARTITIONS"])


def located(reply: dict[str, Any], location: str) -> float:
    """A metrics-api trigger's valueLocation (GJSON: dots between keys) in a JSON reply."""
    value: Any = reply
    for key in location.split("."):
        value = value[key]
    return float(value)


def test_scaled_objects_match_names_and_the_local_policy() -> None:
    scaled = of_kind("ScaledObject")
    auths = of_kind("TriggerAuthentication")
    deployments = of_kind("Deployment")
    api = cluster_settings("api")
    policies = local_policies(api)
    assert set(scaled) == set(names.POOLS)
    for pool, obj in scaled.items():
        assert obj["apiVersion"] == "keda.sh/v1alpha1"
        spec, policy = obj["spec"], policies[pool]
        assert spec["scaleTargetRef"]["name"] == pool and pool in deployments
        assert spec["scaleTargetRef"].get("kind", "Deployment") == "Deployment"
        assert spec.get("minReplicaCount", 0) == policy.min_replicas
        assert spec["maxReplicaCount"] == policy.max_replicas
        assert spec["cooldownPeriod"] == policy.scale_in_cooldown_s
        assert spec.get("pollingInterval", 30) == policy.poll_interval_s
        [trigger] = spec["triggers"]
        meta = trigger["metadata"]
        assert all(isinstance(v, str) for v in meta.values())
        # the pool's load over every partition (a redis-streams trigger would read one stream: one partition)
        assert trigger["type"] == "metrics-api", f"{pool}: {trigger['type']}"
        url = urlsplit(meta["url"])
        assert url.hostname and url.port
        workload, port = service_backend(url.hostname, url.port)
        served = cluster_settings(workload)
        assert workload == "api" and api_serves(url.path)
        # /scaling is kept to the internal port when keys are required
        assert port == (served.internal_port_number if served.auth_required else served.port)
        assert meta["valueLocation"] == f"{pool}.load"  # GET /scaling: {pool: {"load": ...}}
        assert float(meta["targetValue"]) == policy.lag_per_replica  # load is in lag units
        assert spec["fallback"]["replicas"] == policy.max_replicas  # blind, it keeps capacity
        assert "authenticationRef" not in trigger or trigger["authenticationRef"]["name"] in auths


def test_keda_wants_what_the_local_autoscaler_wants() -> None:
    """Over a grid of queue states and current counts, KEDA (from its metric) and the local policy
    (from the same signals) want the same number of replicas."""
    api, engines = cluster_settings("api"), cluster_settings(names.INFERENCE_POOL)
    policies = local_policies(api)
    mismatches = []
    for pool, obj in of_kind("ScaledObject").items():
        spec, policy = obj["spec"], policies[pool]
        per = policy.lag_per_replica
        lags = sorted({v for k in range(policy.max_replicas + 2) for v in (k * per - 1, k * per, k * per + 1)
                       if v >= 0} | {policy.activation_lag, policy.activation_lag + 1})
        capacity = engines.max_num_seqs if pool == names.INFERENCE_POOL else 0
        running = sorted({0, 1, *range(0, capacity * (policy.max_replicas + 1) + 1, max(capacity // 4, 1))}
                         if capacity else {0})
        for lag in lags:
            for held in running:
                truth = PoolSignals(lag=lag, running=held, capacity_per_replica=capacity)
                # GET /scaling: the API's load, counted with its own MAX_NUM_SEQS and lag per replica
                seen = PoolSignals(lag=lag, running=held, capacity_per_replica=api.max_num_seqs)
                metric = float(pool_load(seen, policies[pool].lag_per_replica))
                for current in range(1, policy.max_replicas + 1):
                    local = desired_replicas(policy, truth, current, 0.0, PolicyState()).wanted
                    keda = keda_wants(spec, metric, current)
                    if local != keda:
                        mismatches.append((pool, lag, held, current, local, keda))
    assert not mismatches, f"(pool, lag, running, current, local, keda): {mismatches[:8]}"


def test_hpa_behavior_matches_the_cooldown_and_validates() -> None:
    policies = local_policies(cluster_settings("api"))
    for pool, obj in of_kind("ScaledObject").items():
        behavior = obj["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        policy = policies[pool]
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] == policy.scale_in_cooldown_s
        assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 0
        step = max(p["value"] for p in behavior["scaleUp"]["policies"] if p["type"] == "Pods")
        assert step >= policy.max_replicas  # one step reaches the top: scale-out is not rate-limited
        hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
               "metadata": {"name": pool},
               "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": pool},
                        "minReplicas": max(policy.min_replicas, 1), "maxReplicas": policy.max_replicas,
                        "behavior": behavior}}
        kubernetes_validate.validate(hpa, KUBERNETES_VERSION, strict=True)


def test_keda_holds_only_credentials_a_trigger_uses() -> None:
    """KEDA reads the queues through the API, not from Redis: every authenticationRef names a
    TriggerAuthentication, and none is there (with a Redis password) that no trigger uses."""
    auths = of_kind("TriggerAuthentication")
    used = {t["authenticationRef"]["name"] for o in of_kind("ScaledObject").values()
            for t in o["spec"]["triggers"] if "authenticationRef" in t}
    assert used == set(auths)
    for auth in auths.values():
        assert auth["apiVersion"] == "keda.sh/v1alpha1"


@pytest.mark.parametrize("partitions", [1, cluster_partitions()], ids=["one-node", "redis-cluster"])
def test_scaling_reports_every_partitions_lag(tmp_path: Path, partitions: int) -> None:
    """GET /scaling, served by the API as deployed, with REDIS_PARTITIONS as deployed (one node, or the Redis
    Cluster component's): the value each trigger reads is the pool's load over the streams of every partition
    (POOL_STREAMS, the local autoscaler's): the lag, and the entries delivered that no live engine holds (here no
    worker runs: each needs one as a queued job does)."""
    server = RedisServer(tmp_path / "redis", maxmemory_mb=64)
    url = server.start()
    try:
        r = redis.Redis.from_url(url)
        lags: dict[str, list[int]] = {pool: [] for pool in POOL_STREAMS}  # by partition
        for pool, (streams, group) in POOL_STREAMS.items():
            kind = names.stream_kind(streams[0])  # (the deployment's partitions, not this process's)
            for p in range(partitions):
                stream = names.stream(kind, p)
                r.xgroup_create(stream, group, id="0", mkstream=True)
                for i in range(p % 4 + 2):
                    r.xadd(stream, {"n": i})
                r.xreadgroup(group, "worker", {stream: ">"}, count=1)  # pending, on a worker gone: load
                lags[pool].append(p % 4 + 1)
        r.close()
        api_env = container_env(container(workloads()["api"]))
        env = ({k: v for k, v in os.environ.items() if k not in SETTINGS_ENV} | api_env
               | {"REDIS_URL": url, "REDIS_PARTITIONS": str(partitions), "XDG_CACHE_HOME": str(tmp_path / "cache"),
                  "CONVEYOR_CACHE": str(tmp_path / "cache" / "conveyor")})
        out = subprocess.run([sys.executable, "-c", SCALING], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=120)
    finally:
        server.stop()
    assert out.returncode == 0, out.stderr[-3000:]
    reply = json.loads(out.stdout.strip().splitlines()[-1])
    policies = local_policies(cluster_settings("api"))
    for pool, obj in of_kind("ScaledObject").items():
        [trigger] = obj["spec"]["triggers"]
        seen = located(reply, trigger["metadata"]["valueLocation"])
        total = sum(lags[pool])
        assert reply[pool]["lag"] == total
        load = pool_load(PoolSignals(lag=total, pending=partitions), policies[pool].lag_per_replica)
        assert seen == float(load) == total + partitions
        if partitions > 1:  # more than partition 0's lag, which a redis-streams trigger on its stream would see
            assert seen > lags[pool][0]
