"""Deployment files: the Kubernetes manifests validate offline, KEDA's objects agree with shared.names
and with the local policy, docker-compose.yml runs the same commands, and both are locked down: no
password committed, default-deny network policies, read-only root filesystems, pinned images."""

from __future__ import annotations

import ipaddress
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from shared import names
from shared.policy import DEFAULT_POLICIES
from shared.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "infra" / "k8s"
KUBERNETES_VERSION = "1.30"
CORE_KINDS = {"Namespace", "ConfigMap", "Secret", "Service", "Deployment", "StatefulSet",
              "PodDisruptionBudget", "NetworkPolicy"}
IMAGE = "conveyor:0.1.0"
REDIS_URL = "redis://:$(REDIS_PASSWORD)@redis.conveyor.svc.cluster.local:6379/0"
CONVEYOR_COMPONENTS = {"api", "tokenizer", "inference", "celery-worker", "celery-beat"}
PRIVATE_V4 = {"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16", "127.0.0.0/8", "100.64.0.0/10"}
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


def workloads() -> dict[str, dict[str, Any]]:
    return of_kind("Deployment") | of_kind("StatefulSet")


def all_containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def component(doc: dict[str, Any]) -> str:
    return str(doc["metadata"]["labels"]["app.kubernetes.io/component"])


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
        assert c["image"] == IMAGE
        env = [e["name"] for e in c["env"]]
        # the URL is built from the password, which must come first for $(REDIS_PASSWORD) to expand
        assert env.index("REDIS_PASSWORD") < env.index("REDIS_URL")
        env_by_name = {e["name"]: e for e in c["env"]}
        assert env_by_name["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
            "name": "conveyor-redis", "key": "REDIS_PASSWORD"}
        assert env_by_name["REDIS_URL"]["value"] == REDIS_URL


def test_probes() -> None:
    deployments = of_kind("Deployment")
    api = container(deployments["api"])
    assert api["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert api["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert {p["name"]: p["containerPort"] for p in api["ports"]} == {"http": 8000, "internal": 8001}
    for pool in names.POOLS:
        probe = container(deployments[pool])["livenessProbe"]
        assert probe["exec"]["command"] == ["conveyor", pool, "--check"]


def test_inference_has_a_gpu_and_time_to_drain() -> None:
    inference = of_kind("Deployment")["inference"]
    assert container(inference)["resources"]["limits"]["nvidia.com/gpu"] == 1
    drain = float(of_kind("ConfigMap")["conveyor"]["data"]["DRAIN_GRACE_S"])
    assert drain == Settings.model_fields["drain_grace_s"].default
    assert inference["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain


def test_configmap_holds_settings_and_no_secret() -> None:
    data = of_kind("ConfigMap")["conveyor"]["data"]
    assert set(data) - settings_env_names() <= {"XDG_CACHE_HOME", "LOG_LEVEL"}
    assert "REDIS_URL" not in data and "REDIS_PASSWORD" not in data
    assert all(isinstance(v, str) for v in data.values())
    assert {"MODEL", "MAX_NUM_SEQS", "TOKENIZER_BATCH", "DRAIN_GRACE_S"} <= set(data)


def test_configmap_values_parse_as_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in of_kind("ConfigMap")["conveyor"]["data"].items():
        monkeypatch.setenv(key, value)
    settings = Settings()  # type: ignore[call-arg]
    assert settings.host == "0.0.0.0" and settings.max_num_seqs == 64
    assert str(settings.cache_dir) == "/cache/conveyor"


def redis_script(command: list[str]) -> str:
    """The shell script that starts redis-server with its password on standard input."""
    assert command[:2] == ["sh", "-c"]
    script = command[2]
    assert script.startswith("exec redis-server - ") and "<<EOF" in script
    return script


def test_redis_is_persistent_capped_and_locked() -> None:
    redis = of_kind("StatefulSet")["redis"]
    c = container(redis)
    script = redis_script(c["command"] + c["args"])
    assert "--appendonly yes" in script and "--maxmemory-policy noeviction" in script
    assert re.search(r"^requirepass \$REDIS_PASSWORD$", script, re.M)  # the config on stdin, not an argument
    limit_gi = int(c["resources"]["limits"]["memory"].removesuffix("Gi"))
    maxmemory_gb = int(re.search(r"--maxmemory (\d+)gb", script).group(1))  # type: ignore[union-attr]
    assert maxmemory_gb < limit_gi  # refuse writes before the kernel kills it
    assert "REDISCLI_AUTH" in " ".join(c["readinessProbe"]["exec"]["command"])
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
            ports = {p["name"]: p["port"] for p in of_kind("Service")["api"]["spec"]["ports"]}
            api_env = {e["name"]: e.get("value") for e in container(deployments["api"])["env"]}
            assert api_env["INTERNAL_PORT"] == str(ports["internal"])  # /scaling is on the internal port
            assert meta["url"] == f"http://api.conveyor.svc.cluster.local:{ports['internal']}/scaling"
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


KUSTOMIZATION = load(K8S / "kustomization.yaml")[0]


def test_trigger_authentication_reads_the_redis_password() -> None:
    [auth] = of_kind("TriggerAuthentication").values()
    assert auth["apiVersion"] == "keda.sh/v1alpha1"
    [ref] = auth["spec"]["secretTargetRef"]
    assert ref["parameter"] == "password"
    assert (ref["name"], ref["key"]) == ("conveyor-redis", "REDIS_PASSWORD")


def test_the_redis_password_is_generated_never_committed() -> None:
    assert "Secret" not in {d["kind"] for d in DOCS}
    [gen] = KUSTOMIZATION["secretGenerator"]
    assert gen["name"] == "conveyor-redis" and gen["envs"] == ["redis.env"]
    assert gen["options"]["disableNameSuffixHash"] is True  # KEDA's reference is not rewritten
    # the documented step writes the key the manifests read
    assert 'echo "REDIS_PASSWORD=$(openssl rand -hex 32)" > infra/k8s/redis.env' in (
        K8S / "kustomization.yaml").read_text()
    assert {"infra/k8s/redis.env", ".env"} <= set((ROOT / ".gitignore").read_text().splitlines())
    if (ROOT / ".git").exists():
        tracked = subprocess.run(["git", "ls-files", "infra/k8s", ".env"], cwd=ROOT, capture_output=True, text=True)
        assert tracked.returncode == 0 and "redis.env" not in tracked.stdout and ".env\n" not in tracked.stdout
    for path in [*K8S.glob("*.yaml"), ROOT / "docker-compose.yml"]:
        text = path.read_text()
        assert "change-me" not in text, path
        assert not re.search(r"redis://:[^$@]+@", text), f"{path}: a password in a URL"
        assert not re.search(r"requirepass +[^$\s]", text), f"{path}: a literal requirepass"
    for name, workload in workloads().items():
        for c in all_containers(workload["spec"]["template"]["spec"]):
            for e in c.get("env", []):
                if "PASSWORD" in e["name"]:
                    assert e["valueFrom"]["secretKeyRef"]["name"] == "conveyor-redis", name


def test_the_api_requires_keys() -> None:
    env = {e["name"]: e.get("value") for e in container(of_kind("Deployment")["api"])["env"]}
    assert env["AUTH"] == "required" and env["INTERNAL_PORT"] == "8001"


def test_every_pod_is_locked_down() -> None:
    for name, workload in workloads().items():
        pod = workload["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False, name
        mounts_ok = {v["name"] for v in pod.get("volumes", [])} | {
            t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
        for c in all_containers(pod):
            sc = c["securityContext"]
            where = f"{name}/{c['name']}"
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert sc.get("runAsNonRoot", pod["securityContext"].get("runAsNonRoot")) is True, where
            image = c["image"]
            assert re.fullmatch(r"[\w.\-/]+:[\w.\-]+(@sha256:[0-9a-f]{64})?", image), f"{where}: {image} unpinned"
            assert not image.endswith(":latest") and image.split(":")[1].count(".") >= 2, f"{where}: {image}"
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            assert set(mounts.values()) <= mounts_ok, where
            if image.startswith("conveyor:"):  # writable: scratch and caches, on volumes
                assert {"/tmp", "/cache"} <= set(mounts), where
    assert KUSTOMIZATION["images"] == [{"name": "conveyor", "newTag": IMAGE.split(":")[1]}]


NETWORK_POLICIES = of_kind("NetworkPolicy")


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels, matchExpressions with In) selects these labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In"
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def pod_labels(name: str) -> dict[str, str]:
    return dict(workloads()[name]["spec"]["template"]["metadata"]["labels"])


def policies_for(name: str, kind: str) -> list[dict[str, Any]]:
    """The policies that allow some `kind` ("Ingress" or "Egress") traffic of this workload's pods."""
    return [p for p in NETWORK_POLICIES.values()
            if kind in p["spec"]["policyTypes"] and p["spec"].get(kind.lower())
            and selects(p["spec"]["podSelector"], pod_labels(name))]


NOTHING = {"matchLabels": {"app.kubernetes.io/component": "none"}}  # a peer without podSelector is no pod here


def ports(rule: dict[str, Any]) -> set[tuple[str, int]]:
    return {(p.get("protocol", "TCP"), p["port"]) for p in rule.get("ports", [])}


def test_network_policies_deny_by_default() -> None:
    deny = NETWORK_POLICIES["default-deny"]["spec"]
    assert deny == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    dns = NETWORK_POLICIES["dns"]["spec"]
    assert dns["podSelector"] == {} and dns["policyTypes"] == ["Egress"]
    [rule] = dns["egress"]
    assert ports(rule) == {("UDP", 53), ("TCP", 53)}
    # a rule without peers allows any peer: only DNS (to any resolver) and the API's port (from anyone)
    open_rules = {(name, kind): ports(r) for name, p in NETWORK_POLICIES.items() for kind in ("ingress", "egress")
                  for r in p["spec"].get(kind, []) if not r.get("from" if kind == "ingress" else "to")}
    assert open_rules == {("dns", "egress"): {("UDP", 53), ("TCP", 53)}, ("api", "ingress"): {("TCP", 8000)}}
    assert all(ports(r) for p in NETWORK_POLICIES.values() for kind in ("ingress", "egress")
               for r in p["spec"].get(kind, []))  # and every rule names its ports


def test_network_policies_let_only_conveyor_and_keda_reach_redis() -> None:
    for name in CONVEYOR_COMPONENTS:
        egress = [r for p in policies_for(name, "Egress") for r in p["spec"]["egress"]]
        assert any(("TCP", 6379) in ports(r) and any(selects(t.get("podSelector", NOTHING), pod_labels("redis"))
                                                     for t in r.get("to", []))
                   for r in egress), name
    [redis_in] = policies_for("redis", "Ingress")
    [rule] = redis_in["spec"]["ingress"]
    assert ports(rule) == {("TCP", 6379)}
    pods = [p for p in rule["from"] if "podSelector" in p]
    namespaces = [p for p in rule["from"] if "podSelector" not in p]
    allowed = {n for n in workloads() if any(selects(p["podSelector"], pod_labels(n)) for p in pods)}
    assert allowed == CONVEYOR_COMPONENTS
    assert [p["namespaceSelector"]["matchLabels"] for p in namespaces] == [{"kubernetes.io/metadata.name": "keda"}]
    assert [p["metadata"]["name"] for p in policies_for("redis", "Egress")] == ["dns"]  # nothing else goes out


def test_network_policies_open_the_api_port_and_keep_the_internal_one_for_monitoring() -> None:
    [api_in] = policies_for("api", "Ingress")
    public, internal = api_in["spec"]["ingress"]
    assert ports(public) == {("TCP", 8000)} and "from" not in public  # from anywhere
    assert ports(internal) == {("TCP", 8001)}
    assert {p["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] for p in internal["from"]} == {
        "monitoring", "keda"}
    assert all(set(p) == {"namespaceSelector"} for p in internal["from"])
    for name in CONVEYOR_COMPONENTS - {"api"}:
        assert policies_for(name, "Ingress") == [], name  # nothing reaches the workers


def test_network_policies_let_celery_reach_only_public_addresses() -> None:
    public = [r for p in policies_for("celery-worker", "Egress") for r in p["spec"]["egress"]
              if any("ipBlock" in t for t in r.get("to", []))]
    [rule] = public
    assert ports(rule) == {("TCP", 80), ("TCP", 443)}
    blocks = {t["ipBlock"]["cidr"]: set(t["ipBlock"]["except"]) for t in rule["to"]}
    assert set(blocks) == {"0.0.0.0/0", "::/0"}
    assert PRIVATE_V4 <= blocks["0.0.0.0/0"]
    assert {"fc00::/7", "fe80::/10", "::1/128", "::ffff:0:0/96"} <= blocks["::/0"]
    for cidr in blocks["::/0"] | blocks["0.0.0.0/0"]:
        ipaddress.ip_network(cidr)  # well-formed
    # the beat, the API and redis get no public egress; the pools only 443, for the model pull
    for name in ("celery-beat", "api", "redis"):
        assert not any("ipBlock" in t for p in policies_for(name, "Egress") for r in p["spec"].get("egress", [])
                       for t in r.get("to", [])), name
    for name in ("tokenizer", "inference"):
        [pull] = [r for p in policies_for(name, "Egress") for r in p["spec"]["egress"]
                  if any("ipBlock" in t for t in r.get("to", []))]
        assert ports(pull) == {("TCP", 443)}
        assert PRIVATE_V4 <= set(pull["to"][0]["ipBlock"]["except"])


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl")
def test_kustomize_builds_and_validates(tmp_path: Path) -> None:
    build = tmp_path / "k8s"
    shutil.copytree(K8S, build, ignore=shutil.ignore_patterns("redis.env"))
    (build / "redis.env").write_text("REDIS_PASSWORD=" + "ab" * 32 + "\n")  # as the documented step writes it
    out = subprocess.run(["kubectl", "kustomize", str(build)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    for doc in docs:
        if doc["kind"] in CORE_KINDS:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        assert doc["kind"] == "Namespace" or doc["metadata"]["namespace"] == "conveyor"
    [secret] = [d for d in docs if d["kind"] == "Secret"]
    assert secret["metadata"]["name"] == "conveyor-redis" and set(secret["data"]) == {"REDIS_PASSWORD"}
    images = {c["image"] for d in docs if d["kind"] in ("Deployment", "StatefulSet")
              for c in all_containers(d["spec"]["template"]["spec"])}
    assert images == {IMAGE, "redis:7.2.5"}


COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def compose_command(service: dict[str, Any]) -> list[str]:
    return [*service.get("entrypoint", []), *service.get("command", [])]


def interpolate(value: str, env: dict[str, str]) -> str:
    """docker compose's interpolation, as far as docker-compose.yml uses it."""

    def one(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if env.get(name):
            return env[name]
        if op == ":?":
            raise ValueError(arg)
        return arg or ""

    parts = value.split("$$")
    return "$".join(re.sub(r"\$\{(\w+)(?:(:\?|:-)([^}]*))?\}", one, p) for p in parts)


def test_compose_services_and_commands() -> None:
    services = COMPOSE["services"]
    assert set(COMMANDS) | {"redis", "inference-cpu"} <= set(services)
    for name, command in COMMANDS.items():
        assert compose_command(services[name])[: len(command)] == command
        assert services[name]["image"] == "conveyor:latest"  # built here (`build:`), never pulled
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert compose_command(services["inference-cpu"]) == ["conveyor", "inference"]


def test_compose_environment_and_health() -> None:
    services = COMPOSE["services"]
    env = COMPOSE["x-env"]
    assert env["XDG_CACHE_HOME"] == "/cache"
    assert "/healthz" in " ".join(services["api"]["healthcheck"]["test"])
    for pool in names.POOLS:
        assert services[pool]["healthcheck"]["test"][-3:] == ["conveyor", pool, "--check"]
        assert services[pool]["environment"]["REDIS_URL"] == env["REDIS_URL"]
        assert "cache:/cache" in services[pool]["volumes"]


def test_compose_redis_has_a_password() -> None:
    services = COMPOSE["services"]
    secret = {"REDIS_PASSWORD": "ab" * 32}
    for name, service in services.items():
        if name != "redis":  # every conveyor service reaches Redis with the password
            assert interpolate(service["environment"]["REDIS_URL"], secret) == f"redis://:{'ab' * 32}@redis:6379/0"
    with pytest.raises(ValueError, match="set REDIS_PASSWORD"):  # no password: compose refuses to start
        interpolate(COMPOSE["x-env"]["REDIS_URL"], {})
    redis = services["redis"]
    assert redis["image"] == "redis:7.2.5"
    script = interpolate(redis_script(redis["command"]), {})
    assert "--appendonly yes" in script and "--maxmemory-policy noeviction" in script
    assert re.search(r"^requirepass \$REDIS_PASSWORD$", script, re.M)
    assert interpolate(redis["environment"]["REDIS_PASSWORD"], secret) == secret["REDIS_PASSWORD"]
    health = interpolate(" ".join(redis["healthcheck"]["test"]), {})
    assert 'REDISCLI_AUTH="$REDIS_PASSWORD" redis-cli ping | grep -q PONG' in health
    # the documented command makes the .env file compose reads
    assert '[ -f .env ] || echo "REDIS_PASSWORD=$(openssl rand -hex 32)" > .env; docker compose' in (
        ROOT / "docker-compose.yml").read_text()
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
