"""The deployment files, loaded and parsed: the Kubernetes manifests and their kustomization, docker-compose.yml
and the Dockerfile, with the command lines each runs and the ports its Services reach."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "infra" / "k8s"
NAMESPACE = "conveyor"
KUBERNETES_VERSION = "1.30"
CORE_KINDS = {"Namespace", "ConfigMap", "Secret", "Service", "Deployment", "StatefulSet",
              "PodDisruptionBudget", "NetworkPolicy"}
KEDA_KINDS = {"ScaledObject", "TriggerAuthentication"}
COMPONENT = "app.kubernetes.io/component"
PYPROJECT: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT: dict[str, Any] = PYPROJECT["project"]
# what stands in for a generated password: the documented steps make 64 hex digits
PASSWORD = "ab" * 32
REDIS_DEFAULT_PORT = 6379


# ---- the files ---------------------------------------------------------------------------------------


def load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
DOCS = [doc for p in MANIFESTS for doc in load(p)]
KUSTOMIZATION = load(K8S / "kustomization.yaml")[0]
COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def of_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in DOCS if d["kind"] == kind}


def workloads() -> dict[str, dict[str, Any]]:
    return of_kind("Deployment") | of_kind("StatefulSet")


def pod_spec(name: str) -> dict[str, Any]:
    return dict(workloads()[name]["spec"]["template"]["spec"])


def container(workload: dict[str, Any]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def all_containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def pod_labels(name: str) -> dict[str, str]:
    return dict(workloads()[name]["spec"]["template"]["metadata"]["labels"])


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """Whether a label selector (matchLabels and matchExpressions) selects these labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def quantity(value: str | int) -> int:
    """A Kubernetes memory quantity in bytes."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    text = str(value)
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return int(float(text.removesuffix(suffix)) * factor)
    return int(text)


def duration_s(value: str) -> float:
    """A docker compose duration ("45s", "1m30s") in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", value)
    assert parts and "".join(n + u for n, u in parts) == value, f"not a duration: {value!r}"
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    return sum(float(n) * scale[u] for n, u in parts)


# ---- the Dockerfile ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Instruction:
    keyword: str
    value: str


def dockerfile_instructions(text: str) -> list[Instruction]:
    """The Dockerfile's instructions, continuation lines joined and comments dropped."""
    out, pending = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or not (line or pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, value = (pending + line).partition(" ")
        out.append(Instruction(keyword.upper(), value.strip()))
        pending = ""
    return out


DOCKERFILE = dockerfile_instructions((ROOT / "Dockerfile").read_text())


def instructions(keyword: str) -> list[str]:
    return [i.value for i in DOCKERFILE if i.keyword == keyword]


def exec_form(value: str) -> list[str]:
    return [str(v) for v in json.loads(value)] if value.startswith("[") else ["/bin/sh", "-c", value]


def assignments(values: Iterable[str]) -> dict[str, str]:
    """NAME=value pairs of ARG and ENV lines (a bare ARG NAME has the default "")."""
    out: dict[str, str] = {}
    for value in values:
        words = shlex.split(value)
        if "=" not in words[0]:  # the legacy `ENV NAME value`
            out[words[0]] = " ".join(words[1:])
            continue
        for word in words:
            name, _, default = word.partition("=")
            out[name] = default
    return out


DOCKER_ARGS = assignments(instructions("ARG"))
IMAGE_ENV = assignments(instructions("ENV"))
ENTRYPOINT = exec_form(instructions("ENTRYPOINT")[-1])
CMD = exec_form(instructions("CMD")[-1])
CONVEYOR = ENTRYPOINT[0]  # the console script every conveyor process starts from


def is_app_image(image: str) -> bool:
    """Whether an image reference names the image the Dockerfile builds (named after the project)."""
    return image.split("@")[0].rsplit("/", 1)[-1].split(":")[0] == PROJECT["name"]


def k8s_argv(c: dict[str, Any]) -> list[str]:
    """What a container runs: `command` replaces the image's ENTRYPOINT, `args` its CMD."""
    if "command" in c:
        return [*c["command"], *c.get("args", [])]
    return [*ENTRYPOINT, *c.get("args", CMD)]


def as_argv(value: str | list[str]) -> list[str]:
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]


def compose_argv(service: dict[str, Any]) -> list[str]:
    """What a service built from the Dockerfile runs: an `entrypoint` drops the image's CMD too."""
    entry = as_argv(service.get("entrypoint", ENTRYPOINT))
    return [*entry, *as_argv(service.get("command", [] if "entrypoint" in service else CMD))]


def healthcheck_argv(test: str | list[str]) -> list[str]:
    if isinstance(test, str):
        return ["/bin/sh", "-c", test]
    if test[0] == "CMD-SHELL":
        return ["/bin/sh", "-c", test[1]]
    assert test[0] == "CMD", test
    return [str(t) for t in test[1:]]


# ---- docker compose ----------------------------------------------------------------------------------


def interpolate(value: str, env: Mapping[str, str]) -> str:
    """docker compose's interpolation: $$, $NAME, ${NAME}, ${NAME:-default}, ${NAME-default},
    ${NAME:?error} and ${NAME?error}."""

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group("braced") or m.group("plain")
        op, arg = m.group("op") or "", m.group("arg") or ""
        present = bool(env.get(name)) if op.startswith(":") else name in env
        if op.endswith("?") and not present:
            raise ValueError(arg or f"{name} is required")
        if op.endswith("-") and not present:
            return arg
        return env.get(name, "")

    return re.sub(r"\$\$|\$\{(?P<braced>\w+)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|\$(?P<plain>\w+)", one, value)


def compose_services() -> dict[str, dict[str, Any]]:
    return dict(COMPOSE["services"])


def built_services() -> dict[str, dict[str, Any]]:
    """The compose services that run the image the Dockerfile builds."""
    return {n: s for n, s in compose_services().items() if "build" in s}


def compose_mounts(service: dict[str, Any]) -> dict[str, str]:
    """{target: source} of a service's volumes (short syntax)."""
    out = {}
    for volume in service.get("volumes", []):
        source, target = str(volume).split(":")[:2]
        out[target] = source
    return out


def compose_volume_at(service: dict[str, Any], path: str | Path) -> str | None:
    mounts = sorted(compose_mounts(service).items(), key=lambda m: -len(m[0]))
    return next((source for target, source in mounts if PurePosixPath(path).is_relative_to(target)), None)


def depends_on(service: dict[str, Any]) -> dict[str, str]:
    deps = service.get("depends_on", {})
    if isinstance(deps, list):
        return {d: "service_started" for d in deps}
    return {d: spec.get("condition", "service_started") for d, spec in deps.items()}


# ---- services, ports and Redis -----------------------------------------------------------------------


def redis_listen_port(script: str) -> int:
    """The port redis-server listens on, from the options and stdin configuration of its start script."""
    found = re.search(r"(?:--port\s+|^\s*port\s+)(\d+)", script, re.M)
    return int(found.group(1)) if found else REDIS_DEFAULT_PORT


def service_backend(host: str, port: int) -> tuple[str, int]:
    """The workload and container port that `host:port` (a Service's DNS name) reaches."""
    service_name, _, rest = host.partition(".")
    assert rest in ("", NAMESPACE, f"{NAMESPACE}.svc", f"{NAMESPACE}.svc.cluster.local"), host
    service = of_kind("Service")[service_name]["spec"]
    [workload] = [n for n in workloads() if selects({"matchLabels": service["selector"]}, pod_labels(n))]
    ports = {p.get("name"): p["containerPort"] for p in container(workloads()[workload]).get("ports", [])}
    if service.get("clusterIP") == "None":  # headless: clients reach the pods at the port they name
        target: int | str = port
    else:
        [service_port] = [p for p in service["ports"] if p["port"] == port]
        target = service_port.get("targetPort", port)
    target = ports[target] if isinstance(target, str) else target
    assert target in ports.values(), f"{host}:{port} reaches no port of {workload}"
    return workload, int(target)


def redis_script(argv: list[str]) -> str:
    assert argv[:2] in (["sh", "-c"], ["/bin/sh", "-c"]), argv
    return argv[2]


def redis_image_major(image: str) -> int:
    name, _, tag = image.partition(":")
    assert name.rsplit("/", 1)[-1] == "redis", image
    found = re.match(r"(\d+)", tag)
    assert found, f"{image}: no version in the tag"
    return int(found.group(1))


# ---- the Redis Cluster component (infra/k8s/redis-cluster) -------------------------------------------

REDIS_CLUSTER = K8S / "redis-cluster"
# list fields that Kubernetes' strategic merge merges item by item, and the key that matches items
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
              "volumeMounts": "mountPath", "ports": "containerPort"}


def strategic_merge(base: Any, patch: Any) -> Any:
    """A strategic-merge patch as kustomize applies it: mappings merge, lists of MERGE_KEYS merge by their
    key, the patch's items first and in its order, then the base's others (so an env variable a patch
    names moves up to where the patch puts it); anything else is replaced."""
    if not (isinstance(base, dict) and isinstance(patch, dict)):
        return patch
    out = dict(base)
    for key, value in patch.items():
        if key in MERGE_KEYS and isinstance(value, list) and isinstance(out.get(key), list):
            by = MERGE_KEYS[key]
            old = {item[by]: item for item in out[key]}
            named = {item[by] for item in value}
            out[key] = [strategic_merge(old.get(item[by], {}), item) for item in value] + [
                item for item in out[key] if item[by] not in named]
        else:
            out[key] = strategic_merge(out.get(key), value)
    return out


def redis_cluster_component() -> dict[str, Any]:
    return load(REDIS_CLUSTER / "kustomization.yaml")[0]


def with_redis_cluster() -> list[dict[str, Any]]:
    """The base's documents with the Redis Cluster component applied: its patches, then its resources."""
    component = redis_cluster_component()
    docs = [dict(d) for d in DOCS]
    for entry in component.get("patches", []):
        for patch in load(REDIS_CLUSTER / entry["path"]):
            at = [i for i, d in enumerate(docs) if (d["kind"], d["metadata"]["name"]) ==
                  (patch["kind"], patch["metadata"]["name"])]
            assert len(at) == 1, f"the patch of {patch['kind']}/{patch['metadata']['name']} matches {len(at)}"
            docs[at[0]] = strategic_merge(docs[at[0]], patch)
    for resource in component.get("resources", []):
        docs += load(REDIS_CLUSTER / resource)
    return docs


def kinds_in(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}
