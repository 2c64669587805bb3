"""Deployment files: the Kubernetes manifests validate offline, KEDA's objects agree with shared.names
and with the local policy, and docker-compose.yml runs the same commands."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from infra.policy import DEFAULT_POLICIES
from shared import names
from shared.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "infra" / "k8s"
KUBERNETES_VERSION = "1.30"
CORE_KINDS = {"Namespace", "ConfigMap", "Secret", "Service", "Deployment", "StatefulSet",
              "PodDisruptionBudget"}
KEDA_KINDS = {"ScaledObject", "TriggerAuthentication"}
POOL_STREAMS = {
    names.TOKENIZER_POOL: (names.JOBS_STREAM, names.TOKENIZER_GROUP),
    names.INFERENCE_POOL: (names.TOKENIZED_STREAM, names.INFERENCE_GROUP),
}
COMMANDS = {
    "api": ["conveyor", "api"],
    "tokenizer": ["conveyor", "tokenizer"],
    "inference": ["conveyor", "inference"],
    "celery-worker": ["celery", "-A", "workers.celery_app", "worker"],
    "celery-beat": ["celery", "-A", "workers.celery_app", "beat"],
}


def load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
DOCS = [doc for p in MANIFESTS for doc in load(p)]


def of_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in DOCS if d["kind"] == kind}


def container(workload: dict[str, Any]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def settings_env_names() -> set[str]:
    fields = Settings.model_fields.items()
    return {(f.validation_alias if isinstance(f.validation_alias, str) else n).upper() for n, f in fields}


def test_every_manifest_parses_and_is_in_the_kustomization() -> None:
    assert MANIFESTS
    kustomization = load(K8S / "kustomization.yaml")[0]
    assert kustomization["kind"] == "Kustomization"
    assert sorted(kustomization["resources"]) == sorted(p.name for p in MANIFESTS)
    for doc in DOCS:
        assert {"apiVersion", "kind", "metadata"} <= set(doc)
        assert doc["kind"] in CORE_KINDS | KEDA_KINDS, doc["kind"]
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "conveyor"


@pytest.mark.parametrize("doc", [d for d in DOCS if d["kind"] in CORE_KINDS],
                         ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_core_kinds_validate(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_deployments_run_the_right_commands() -> None:
    deployments = of_kind("Deployment")
    assert set(deployments) == set(COMMANDS)
    for name, command in COMMANDS.items():
        c = container(deployments[name])
        assert c["command"][: len(command)] == command
        assert c["image"] == "conveyor:latest"
        env = {e["name"]: e for e in c.get("env", [])}
        assert env["REDIS_URL"]["valueFrom"]["secretKeyRef"]["key"] == "REDIS_URL"


def test_probes() -> None:
    deployments = of_kind("Deployment")
    api = container(deployments["api"])
    assert api["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert api["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert api["ports"][0]["containerPort"] == 8000
    for pool in names.POOLS:
        probe = container(deployments[pool])["livenessProbe"]
        assert probe["exec"]["command"] == ["conveyor", pool, "--check"]


def test_inference_has_a_gpu_and_time_to_drain() -> None:
    inference = of_kind("Deployment")["inference"]
    assert container(inference)["resources"]["limits"]["nvidia.com/gpu"] == 1
    drain = float(of_kind("ConfigMap")["conveyor"]["data"]["DRAIN_GRACE_S"])
    assert drain == Settings.model_fields["drain_grace_s"].default
    assert inference["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain


def test_configmap_holds_settings_and_the_secret_holds_the_redis_url() -> None:
    data = of_kind("ConfigMap")["conveyor"]["data"]
    assert set(data) - settings_env_names() <= {"XDG_CACHE_HOME", "LOG_LEVEL"}
    assert "REDIS_URL" not in data
    assert all(isinstance(v, str) for v in data.values())
    assert {"MODEL", "MAX_NUM_SEQS", "TOKENIZER_BATCH", "DRAIN_GRACE_S"} <= set(data)
    secret = of_kind("Secret")["conveyor-redis"]["stringData"]
    assert secret["REDIS_URL"].startswith("redis://")
    assert secret["REDIS_PASSWORD"] in secret["REDIS_URL"]


def test_configmap_values_parse_as_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in of_kind("ConfigMap")["conveyor"]["data"].items():
        monkeypatch.setenv(key, value)
    settings = Settings()  # type: ignore[call-arg]
    assert settings.host == "0.0.0.0" and settings.max_num_seqs == 64
    assert str(settings.cache_dir) == "/cache/conveyor"


def test_redis_is_persistent() -> None:
    redis = of_kind("StatefulSet")["redis"]
    args = container(redis)["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert "redis" in of_kind("Service") and "api" in of_kind("Service")


def test_disruption_budgets() -> None:
    assert set(of_kind("PodDisruptionBudget")) == {"api", "tokenizer", "inference"}


def test_scaled_objects_match_names_and_the_local_policy() -> None:
    scaled = of_kind("ScaledObject")
    auths = of_kind("TriggerAuthentication")
    deployments = of_kind("Deployment")
    assert set(scaled) == set(names.POOLS)
    for pool, obj in scaled.items():
        assert obj["apiVersion"] == "keda.sh/v1alpha1"
        spec, policy = obj["spec"], DEFAULT_POLICIES[pool]
        assert spec["scaleTargetRef"]["name"] == pool and pool in deployments
        assert spec["scaleTargetRef"].get("kind", "Deployment") == "Deployment"
        assert spec["minReplicaCount"] == policy.min_replicas
        assert spec["maxReplicaCount"] == policy.max_replicas
        assert spec["cooldownPeriod"] == policy.scale_in_cooldown_s
        assert spec["pollingInterval"] == policy.poll_interval_s
        [trigger] = spec["triggers"]
        meta = trigger["metadata"]
        assert all(isinstance(v, str) for v in meta.values())
        if pool == names.INFERENCE_POOL:  # lag plus occupancy, from the API's GET /scaling
            assert trigger["type"] == "metrics-api"
            port = of_kind("Service")["api"]["spec"]["ports"][0]["port"]
            assert meta["url"] == f"http://api.conveyor.svc.cluster.local:{port}/scaling"
            assert meta["valueLocation"] == f"{pool}.load"
            assert int(meta["targetValue"]) == policy.lag_per_replica
            assert int(meta["activationTargetValue"]) == policy.activation_lag
            assert spec["fallback"]["replicas"] == policy.max_replicas
            continue
        assert trigger["type"] == "redis-streams"
        assert (meta["stream"], meta["consumerGroup"]) == POOL_STREAMS[pool]
        assert int(meta["lagCount"]) == policy.lag_per_replica
        assert int(meta["activationLagCount"]) == policy.activation_lag
        assert "address" in meta or "addressFromEnv" in meta
        assert trigger["authenticationRef"]["name"] in auths


def test_hpa_behavior_matches_the_cooldown_and_validates() -> None:
    for pool, obj in of_kind("ScaledObject").items():
        behavior = obj["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        policy = DEFAULT_POLICIES[pool]
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
    [auth] = of_kind("TriggerAuthentication").values()
    assert auth["apiVersion"] == "keda.sh/v1alpha1"
    [ref] = auth["spec"]["secretTargetRef"]
    assert ref["parameter"] == "password"
    assert ref["key"] in of_kind("Secret")[ref["name"]]["stringData"]


COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def compose_command(service: dict[str, Any]) -> list[str]:
    return [*service.get("entrypoint", []), *service.get("command", [])]


def test_compose_services_and_commands() -> None:
    services = COMPOSE["services"]
    assert set(COMMANDS) | {"redis", "inference-cpu"} <= set(services)
    for name, command in COMMANDS.items():
        assert compose_command(services[name])[: len(command)] == command
        assert services[name]["image"] == "conveyor:latest"
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert compose_command(services["inference-cpu"]) == ["conveyor", "inference"]


def test_compose_environment_and_health() -> None:
    services = COMPOSE["services"]
    env = COMPOSE["x-env"]
    assert env["REDIS_URL"] == "redis://redis:6379/0"
    assert env["XDG_CACHE_HOME"] == "/cache"
    redis = services["redis"]
    assert redis["image"].startswith("redis:7")
    assert "--appendonly" in redis["command"] and redis["healthcheck"]["test"][-2:] == ["redis-cli", "ping"]
    assert "/healthz" in " ".join(services["api"]["healthcheck"]["test"])
    for pool in names.POOLS:
        assert services[pool]["healthcheck"]["test"][-3:] == ["conveyor", pool, "--check"]
        assert services[pool]["environment"]["REDIS_URL"] == env["REDIS_URL"]
        assert "cache:/cache" in services[pool]["volumes"]
    assert services["tokenizer"]["deploy"]["replicas"] == 2


def test_compose_gpu_and_cpu_inference() -> None:
    services = COMPOSE["services"]
    [device] = services["inference"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    cpu = services["inference-cpu"]
    assert cpu["profiles"] == ["cpu"]
    assert cpu["environment"]["DTYPE"] == "float32"
    assert "deploy" not in cpu


def test_dockerfile() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert text.startswith("#") and "FROM python:3.11-slim" in text
    assert 'ARG TORCH_SPEC="torch==2.13.0"' in text
    assert 'pip install ".[gpu]"' in text
    assert 'ENTRYPOINT ["conveyor"]' in text
