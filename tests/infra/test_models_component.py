"""The Kubernetes component for several models (infra/k8s/models), built as `kubectl apply -k` builds it with the
component turned on: one inference Deployment and one ScaledObject per model, their pods never selected by the
other's Deployment, each Deployment serving the model its MODEL_NAME names (one of MODELS), each ScaledObject
reading that model's load from /scaling?model= and scaling it from zero, and the configuration valid settings."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from shared.settings import Settings
from tests.infra.deploy_files import CORE_KINDS, K8S, KUBERNETES_VERSION, KUSTOMIZATION, PASSWORD, selects
from tests.infra.test_k8s import secret_references


def build(tmp_path_factory: pytest.TempPathFactory, components: list[str]) -> list[dict[str, Any]]:
    """The manifests `kubectl kustomize` makes with `components` turned on."""
    if shutil.which("kubectl") is None:
        pytest.skip("no kubectl")
    build = tmp_path_factory.mktemp("k8s-models") / "k8s"
    shutil.copytree(K8S, build, ignore=shutil.ignore_patterns("redis.env"))
    refs = secret_references()
    for gen in KUSTOMIZATION["secretGenerator"]:
        for env_file in gen["envs"]:
            (build / env_file).write_text("".join(f"{key}={PASSWORD}\n" for key in sorted(refs[gen["name"]])))
    kustomization = yaml.safe_load((build / "kustomization.yaml").read_text())
    (build / "kustomization.yaml").write_text(yaml.safe_dump({**kustomization, "components": components}))
    out = subprocess.run(["kubectl", "kustomize", str(build)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return build(tmp_path_factory, ["models"])


def test_with_the_redis_cluster_every_models_pool_reads_the_cluster(tmp_path_factory: pytest.TempPathFactory) -> None:
    docs = build(tmp_path_factory, ["models", "redis-cluster"])
    pools = [d for d in docs if d["kind"] == "Deployment"
             and d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == "inference"]
    assert {d["metadata"]["name"] for d in pools} == {"inference", "inference-second"}
    for d in pools:
        assert "conveyor-redis-leader.redis-cluster" in _env(d)["REDIS_URL"], d["metadata"]["name"]


def _env(deployment: dict[str, Any]) -> dict[str, str]:
    [c] = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value", "") for e in c.get("env", [])}


def test_each_model_has_a_deployment_and_a_scaled_object(built: list[dict[str, Any]]) -> None:
    for doc in built:
        if doc["kind"] in CORE_KINDS or doc["kind"] == "PersistentVolumeClaim":
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    config = next(d["data"] for d in built if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "conveyor")
    settings = Settings(**{k.lower(): v for k, v in config.items() if v != ""})
    # the default model where its pods' `conveyor model pull` puts it (CONVEYOR_CACHE/models/<name>)
    assert settings.served[settings.default_model].path == f"{config['CONVEYOR_CACHE']}/models/{settings.default_model}"
    inference = {d["metadata"]["name"]: d for d in built if d["kind"] == "Deployment"
                 and d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == "inference"}
    served = {_env(d).get("MODEL_NAME") or settings.default_model: name for name, d in inference.items()}
    assert served == {model: "inference" if model == settings.default_model else f"inference-{model}"
                      for model in settings.served}
    for d in inference.values():  # no Deployment selects another's pods
        for other in inference.values():
            if other is not d:
                assert not selects(d["spec"]["selector"], other["spec"]["template"]["metadata"]["labels"])
    scaled = {d["spec"]["scaleTargetRef"]["name"]: d["spec"] for d in built if d["kind"] == "ScaledObject"}
    for model, deployment in served.items():
        [trigger] = scaled[deployment]["triggers"]
        asked = parse_qs(urlparse(trigger["metadata"]["url"]).query).get("model")
        assert asked == (None if model == settings.default_model else [model])
        assert trigger["metadata"]["valueLocation"] == "inference.load"
        if model != settings.default_model:
            assert scaled[deployment]["minReplicaCount"] == 0 and settings.bounds_of(model)[0] == 0
            path = Path(_env(inference[deployment])["MODEL"])
            assert str(path) == settings.path_of(model)
            mounts = {m["mountPath"] for c in ("api", "tokenizer") for d in built if d["kind"] == "Deployment"
                      and d["metadata"]["name"] == c for m in d["spec"]["template"]["spec"]["containers"][0]
                      ["volumeMounts"]}
            assert any(path.is_relative_to(m) for m in mounts)  # the API and the tokenizer pool read its files


def test_every_model_pull_reaches_every_model_it_checks(built: list[dict[str, Any]]) -> None:
    """A `conveyor model pull` without a MODEL of its own pulls or checks every model of MODELS: each directory not
    in its pod's cache is on one of its mounts (else the init container fails, and its pod never starts)."""
    config = next(d["data"] for d in built if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "conveyor")
    settings = Settings(**{k.lower(): v for k, v in config.items() if v != ""})
    for d in built:
        if d["kind"] != "Deployment":
            continue
        for c in d["spec"]["template"]["spec"].get("initContainers", []):
            if c.get("command", [])[:3] != ["conveyor", "model", "pull"]:
                continue
            own = {e["name"]: e.get("value") for e in c.get("env", [])}.get("MODEL")
            paths = [Path(own)] if own else [Path(m.path) for m in settings.served.values()]
            mounts = [Path(m["mountPath"]) for m in c.get("volumeMounts", [])]
            for path in paths:
                assert any(path.is_relative_to(m) for m in mounts), (d["metadata"]["name"], str(path))


def test_every_inference_pool_has_time_to_drain(built: list[dict[str, Any]]) -> None:
    from shared.lifecycle import worker_stop_s

    config = next(d["data"] for d in built if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "conveyor")
    drain = Settings(**{k.lower(): v for k, v in config.items() if v != ""}).drain_grace_s
    pools = [d for d in built if d["kind"] == "Deployment"
             and d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == "inference"]
    assert len(pools) == 2
    for d in pools:  # its drain, then its output lane's last writes
        assert d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > worker_stop_s(drain), d["metadata"]
