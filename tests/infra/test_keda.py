"""KEDA's ScaledObjects ask for the replica counts the local autoscaler (shared/policy.py) would, from the same
signals and within the same bounds, and their HPA behaviour and authentication match."""

from __future__ import annotations

from urllib.parse import urlsplit

import kubernetes_validate  # type: ignore[import-untyped]

from shared import names
from shared.policy import PolicyState, PoolSignals, desired_replicas, pool_load
from shared.signals import POOL_STREAMS
from tests.infra.cluster_model import keda_wants, local_policies
from tests.infra.deploy_files import KUBERNETES_VERSION, container, of_kind, service_backend, workloads
from tests.infra.deploy_processes import api_serves, cluster_settings


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
        if trigger["type"] == "metrics-api":
            url = urlsplit(meta["url"])
            assert url.hostname and url.port
            workload, port = service_backend(url.hostname, url.port)
            served = cluster_settings(workload)
            assert workload == "api" and api_serves(url.path)
            # /scaling is kept to the internal port when keys are required
            assert port == (served.internal_port_number if served.auth_required else served.port)
            assert meta["valueLocation"] == f"{pool}.load"  # GET /scaling: {pool: {"load": ...}}
            assert spec["fallback"]["replicas"] == policy.max_replicas  # blind, it keeps capacity
            continue
        assert trigger["type"] == "redis-streams"
        kind, group = POOL_STREAMS[pool]  # what the local autoscaler reads (one partition: the default)
        assert (meta["stream"], meta["consumerGroup"]) == (names.stream(kind, 0), group)
        host, _, port_text = meta["address"].rpartition(":")
        workload, port = service_backend(host, int(port_text))
        assert workload == "redis"
        pool_url = urlsplit(cluster_settings(pool).redis_url)
        assert int(meta.get("databaseIndex", "0")) == int(pool_url.path.strip("/") or 0)
        assert trigger["authenticationRef"]["name"] in auths


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
                if spec["triggers"][0]["type"] == "metrics-api":
                    # GET /scaling: the API's load, counted with its own MAX_NUM_SEQS and lag per replica
                    seen = PoolSignals(lag=lag, running=held, capacity_per_replica=api.max_num_seqs)
                    metric = float(pool_load(seen, policies[pool].lag_per_replica))
                else:
                    metric = float(lag)  # XINFO GROUPS lag
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


def test_trigger_authentication_reads_the_redis_password() -> None:
    redis_password_key = next(e["valueFrom"]["secretKeyRef"] for e in container(workloads()["redis"])["env"]
                              if e["name"] == "REDIS_PASSWORD")
    for auth in of_kind("TriggerAuthentication").values():
        assert auth["apiVersion"] == "keda.sh/v1alpha1"
        [ref] = auth["spec"]["secretTargetRef"]
        assert ref["parameter"] == "password"
        assert {"name": ref["name"], "key": ref["key"]} == redis_password_key  # what redis-server requires
