"""Deployment files, checked for what their users rely on rather than for the text they hold.

- The Kubernetes manifests parse, are all in the kustomization and validate (strict) against the
  Kubernetes schema; `kubectl kustomize` builds them where kubectl is installed, and docker-compose.yml
  passes `docker compose config` where the compose plugin is installed (and a structural check always).
- Every container and compose service runs a command the image has: `conveyor ...` lines parse with
  infra/cli.py's own argument parser, `celery ...` lines with celery's. Each workload runs the process it
  is named for, and docker-compose.yml runs the same processes as the cluster.
- Probes and health checks reach real routes of the API on a port that serves them, or run a pool's
  `--check`. Redis, started from the files' own shell script with a real redis-server, refuses clients
  without the password, never shows it on a command line, is persistent and capped, and its probe
  passes only with the password.
- Every process's environment (image ENV, ConfigMap, env, the generated Secret) parses as Settings,
  reaches Redis with the password and keeps what it writes on a volume. No secret is committed, and the
  documented steps make exactly the secrets the files read.
- KEDA's ScaledObjects ask for the replica counts the local autoscaler (shared/policy.py) would, from the
  same signals and within the same bounds.
- Pods are locked down, and the network policies, evaluated as Kubernetes evaluates them, let through
  the traffic the processes need and nothing else.
- The image builds its entrypoint: the Dockerfile's COPY and `pip install` lines are replayed into a
  wheel, which declares the ENTRYPOINT's console script and holds every module, data file and
  dependency the processes load; its torch is the Makefile's.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import email
import email.message
import functools
import importlib
import importlib.metadata
import io
import ipaddress
import json
import math
import os
import posixpath
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from fnmatch import fnmatch
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import redis
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from redis.backoff import NoBackoff
from redis.retry import Retry

from infra.autoscale import policies_for
from infra.redis_server import redis_binary
from shared import names
from shared.policy import DEFAULT_POLICIES, PolicyState, PoolPolicy, PoolSignals, desired_replicas, pool_load
from shared.settings import Settings, is_loopback
from shared.signals import POOL_STREAMS

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
REDIS_IMAGE_WORKDIR = "/data"  # the official redis image's working directory: redis-server writes there without --dir
HPA_TOLERANCE = 0.1  # kube-controller-manager's --horizontal-pod-autoscaler-tolerance default
NO_RETRY = Retry(NoBackoff(), 0)
BASE_IMAGE_EXECUTABLES = {"python", "python3", "pip", "sh"}  # what a python:* base image has on its PATH


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


# ---- commands ----------------------------------------------------------------------------------------


class _ParserBuilt(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__("parser built")
        self.parser = parser


@functools.cache
def cli_parser() -> argparse.ArgumentParser:
    """The parser of the console script's function (pyproject's [project.scripts]), built by running
    that function up to the point where it parses its arguments."""
    module, _, function = PROJECT["scripts"][CONVEYOR].partition(":")
    main: Callable[[list[str]], object] = getattr(importlib.import_module(module), function)

    def capture(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> argparse.Namespace:
        raise _ParserBuilt(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "parse_args", capture)
        try:
            main([])
        except _ParserBuilt as built:
            return built.parser
    raise AssertionError(f"{module}.{function} parsed no arguments")


def conveyor_args(argv: list[str]) -> argparse.Namespace:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return cli_parser().parse_args(argv)
    except SystemExit:
        raise AssertionError(f"`{CONVEYOR} {shlex.join(argv)}`: {err.getvalue().strip()}") from None


CELERY_VALUE_OPTIONS = {"-A", "--app", "-b", "--broker", "--result-backend", "--loader", "--config", "--workdir"}


def celery_parts(argv: list[str]) -> tuple[str, str]:
    """(the -A app module, the subcommand) of a `celery ...` command line."""
    app, words = "", iter(argv[1:])
    for word in words:
        if word.startswith("--app="):
            app = word.split("=", 1)[1]
        elif word in CELERY_VALUE_OPTIONS:
            value = next(words)
            app = value if word in ("-A", "--app") else app
        elif not word.startswith("-"):
            return app.split(":")[0], word
    raise AssertionError(f"{shlex.join(argv)}: no celery subcommand")


@functools.cache
def celery_refuses(argv: tuple[str, ...]) -> str:
    """Why celery refuses these arguments ("" when it takes them): it loads the app, finds the
    subcommand and checks its options, then prints the help instead of running."""
    exe = Path(sys.executable).with_name("celery")
    out = subprocess.run([str(exe), *argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    return "" if out.returncode == 0 else (out.stderr.strip() or out.stdout.strip())[-2000:]


def process_of(argv: list[str]) -> str:
    """The process a command line starts, named as workloads are (`api`, `model-pull`, `celery-beat`);
    fails when the image has no such command or refuses its arguments."""
    if argv[0] == CONVEYOR:
        args = conveyor_args(argv[1:])
        sub = getattr(args, f"{args.cmd}_cmd", None)
        return f"{args.cmd}-{sub}" if sub else str(args.cmd)
    if argv[0] == "celery":
        why = celery_refuses(tuple(argv[1:]))
        assert not why, f"`{shlex.join(argv)}`: {why}"
        return f"celery-{celery_parts(argv)[1]}"
    raise AssertionError(f"`{shlex.join(argv)}`: the image has no command {argv[0]!r}")


def api_serves(path: str, method: str = "GET") -> bool:
    """Whether one of the API's routes takes this request (the app's own routing decides)."""
    from starlette.routing import Match

    from api.main import app

    scope = {"type": "http", "path": path, "method": method, "root_path": "", "path_params": {}, "app": app}
    return any(route.matches(scope)[0] == Match.FULL for route in app.routes)


@functools.cache
def internal_paths() -> tuple[str, ...]:
    """The paths kept to the internal port when keys are required."""
    from api.guard import INTERNAL_PATHS

    return tuple(INTERNAL_PATHS)


# ---- settings and environments -----------------------------------------------------------------------

SETTINGS_ENV = {(f.validation_alias if isinstance(f.validation_alias, str) else n).upper()
                for n, f in Settings.model_fields.items()}


@functools.cache
def first_party_source() -> str:
    """The source of the packages the project ships (pyproject's packages.find include)."""
    packages = [p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]]
    return "\n".join(p.read_text() for pkg in packages for p in sorted((ROOT / pkg).rglob("*.py")))


def read_from_environment(name: str) -> bool:
    """Whether a variable is read by the processes: a Settings field, or a name their code reads."""
    return name in SETTINGS_ENV or re.search(rf"[\"']{re.escape(name)}[\"']", first_party_source()) is not None


def settings_from(env: Mapping[str, str]) -> Settings:
    """Settings as a process with exactly this environment (for Settings' names) reads them."""
    with pytest.MonkeyPatch.context() as mp:
        for name in SETTINGS_ENV | {"XDG_CACHE_HOME"}:
            mp.delenv(name, raising=False)
        for name, value in env.items():
            mp.setenv(name, str(value))
        return Settings()


def generated_secrets() -> set[str]:
    return {gen["name"] for gen in KUSTOMIZATION.get("secretGenerator", [])}


def secret_value(name: str, key: str) -> str:
    assert name in generated_secrets(), f"Secret {name!r} is neither committed nor generated: the pod never starts"
    return PASSWORD


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(NAME) expansion: only variables defined before this one; $$ escapes."""
    return re.sub(r"\$\$|\$\((\w+)\)", lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
                  value)


def container_env(c: dict[str, Any]) -> dict[str, str]:
    """A container's environment: the image's ENV, then envFrom, then env in order."""
    env = dict(IMAGE_ENV) if is_app_image(c["image"]) else {}
    for source in c.get("envFrom", []):
        assert set(source) == {"configMapRef"}, source
        env.update(of_kind("ConfigMap")[source["configMapRef"]["name"]]["data"])
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(str(e["value"]), env)
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = secret_value(ref["name"], ref["key"])
    return env


def mount_of(c: dict[str, Any], path: str | Path) -> str | None:
    """The volume a container has at `path` (None: the read-only root filesystem)."""
    mounts = sorted(((m["mountPath"], m["name"]) for m in c.get("volumeMounts", [])), key=lambda m: -len(m[0]))
    return next((name for mount, name in mounts if PurePosixPath(path).is_relative_to(mount)), None)


def app_containers() -> Iterator[tuple[str, dict[str, Any], bool]]:
    """(workload, container, is an init container) for every container running the conveyor image."""
    for name in sorted(workloads()):
        pod = pod_spec(name)
        for c in pod.get("initContainers", []):
            if is_app_image(c["image"]):
                yield name, c, True
        for c in pod["containers"]:
            if is_app_image(c["image"]):
                yield name, c, False


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


def compose_env(service: dict[str, Any], dotenv: Mapping[str, str]) -> dict[str, str]:
    env = service.get("environment", {})
    assert isinstance(env, dict), "environment as a mapping"
    base = dict(IMAGE_ENV) if "build" in service else {}
    return base | {k: interpolate(str(v), dotenv) for k, v in env.items()}


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


def documented_step(text: str, writes: str) -> str:
    """The shell command a file's comments give for making the file `writes`."""
    for line in text.splitlines():
        line = line.strip().lstrip("#").strip()
        end = line.find(f"> {writes}")
        if end >= 0:
            return line[: end + len(f"> {writes}")].split(";")[-1].strip()
    raise AssertionError(f"no documented command writes {writes}")


def run_documented_step(command: str, cwd: Path, writes: str) -> dict[str, str]:
    """Run the step in `cwd` (as if it were the repository root) and read the KEY=value file it makes."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to run the documented step with")
    (cwd / writes).parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["sh", "-c", command], cwd=cwd, check=True, timeout=30)
    lines = (cwd / writes).read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


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


# ---- Kubernetes --------------------------------------------------------------------------------------


def test_every_manifest_parses_and_is_in_the_kustomization() -> None:
    assert MANIFESTS
    assert KUSTOMIZATION["kind"] == "Kustomization"
    assert sorted(KUSTOMIZATION["resources"]) == sorted(p.name for p in MANIFESTS)
    seen = set()
    for doc in DOCS:
        assert {"apiVersion", "kind", "metadata"} <= set(doc)
        assert doc["kind"] in CORE_KINDS | KEDA_KINDS, doc["kind"]
        key = (doc["kind"], doc["metadata"]["name"])
        assert key not in seen, f"{key} twice"
        seen.add(key)
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == NAMESPACE
    for name, workload in workloads().items():  # the API server refuses a selector that misses its pods
        assert selects(workload["spec"]["selector"], pod_labels(name)), name


@pytest.mark.parametrize("doc", [d for d in DOCS if d["kind"] in CORE_KINDS],
                         ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_core_kinds_validate(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_every_workload_runs_the_process_it_is_named_for() -> None:
    """Each container's command parses with the CLI that runs it, and starts the process its workload
    (or init container) is named for."""
    assert process_of([*ENTRYPOINT, *CMD])  # the image's default command
    ran = set()
    for name, c, init in app_containers():
        process = process_of(k8s_argv(c))
        ran.add(process)
        if init:
            assert process == c["name"], f"{name}/{c['name']} runs {process}"
        else:
            assert process == workloads()[name]["metadata"]["labels"][COMPONENT] == name, f"{name} runs {process}"
    assert {names.TOKENIZER_POOL, names.INFERENCE_POOL, "api"} <= ran


def test_probes() -> None:
    """HTTP probes ask the API for a route it has, on a port that serves it; exec probes run a pool's
    `--check` (never a second worker); Services land on ports their pods declare."""
    checked = 0
    for name, c, _ in app_containers():
        settings = settings_from(container_env(c))
        ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = c.get(kind)
            if probe is None:
                continue
            checked += 1
            where = f"{name}/{kind}"
            if "httpGet" in probe:
                path, port = probe["httpGet"]["path"], probe["httpGet"]["port"]
                port = ports[port] if isinstance(port, str) else port
                assert api_serves(path), f"{where}: the API has no GET {path}"
                served = {settings.port, settings.internal_port_number} if settings.auth_required else {settings.port}
                if settings.auth_required and path.startswith(internal_paths()):
                    served = {settings.internal_port_number}
                assert port in served, f"{where}: port {port} does not serve {path}"
            else:  # a pool's probe asks whether that pool has a live worker; it must not start one
                args = conveyor_args(k8s_argv({"command": probe["exec"]["command"]})[1:])
                assert (args.cmd, getattr(args, "check", False)) == (name, True), where
    assert checked >= 4
    for service in of_kind("Service").values():  # every Service port lands on a port its pods declare
        for p in service["spec"]["ports"]:
            service_backend(f"{service['metadata']['name']}.{NAMESPACE}", p["port"])


def test_every_process_gets_settings_that_work() -> None:
    """Each container's environment, resolved as the kubelet resolves it, parses as Settings; it reaches
    Redis with the generated password and keeps what it writes (caches, models, scratch) on volumes."""
    by_workload: dict[str, Settings] = {}
    model_volumes: dict[str, set[str | None]] = {}
    for name, c, init in app_containers():
        env = container_env(c)
        settings = settings_from(env)
        where = f"{name}/{c['name']}"
        for path in (settings.cache_dir, env.get("XDG_CACHE_HOME", settings.cache_dir), env.get("TMPDIR", "/tmp")):
            assert mount_of(c, path), f"{where}: {path} is on the read-only root filesystem"
        argv = k8s_argv(c)
        for option in argv:
            if option.startswith("--schedule="):
                assert mount_of(c, option.split("=", 1)[1]), f"{where}: {option} is not writable"
        model_volumes.setdefault(name, set()).add(mount_of(c, settings.model_path))
        if init:
            continue
        by_workload[name] = settings
        url = urlsplit(settings.redis_url)
        assert url.scheme == "redis" and url.hostname and url.port, f"{where}: REDIS_URL {settings.redis_url!r}"
        assert unquote(url.password or "") == PASSWORD, f"{where}: REDIS_URL without the generated password"
        workload, port = service_backend(url.hostname, url.port)
        redis_c = container(workloads()[workload])
        assert redis_image_major(redis_c["image"]) >= 7, f"{where} reaches {workload}, not Redis"
        assert port == redis_listen_port(redis_script(k8s_argv(redis_c))), f"{where}: Redis does not listen on {port}"
    for name, volumes in model_volumes.items():  # the model the init container pulls is where the worker looks
        assert len(volumes) == 1 and None not in volumes, f"{name}: model on {volumes}"
    api = by_workload["api"]
    assert not is_loopback(api.host), "the API must listen where the Service reaches it"
    ports = {p["containerPort"] for p in container(workloads()["api"])["ports"]}
    assert {api.port, api.internal_port_number} <= ports
    # /scaling counts occupancy in shares of MAX_NUM_SEQS: the API must count with the engines' number
    assert api.max_num_seqs == by_workload[names.INFERENCE_POOL].max_num_seqs


def test_inference_has_a_gpu_and_time_to_drain() -> None:
    inference = workloads()[names.INFERENCE_POOL]
    gpus = container(inference)["resources"]["limits"]["nvidia.com/gpu"]
    assert isinstance(gpus, int) and gpus >= 1
    drain = settings_from(container_env(container(inference))).drain_grace_s
    assert inference["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain


def test_configmap_holds_settings_and_no_secret() -> None:
    for configmap in of_kind("ConfigMap").values():
        data = configmap["data"]
        assert all(isinstance(v, str) for v in data.values())
        unread = sorted(k for k in data if not read_from_environment(k))
        assert not unread, f"nothing reads {unread}"
        secret = sorted(k for k in data if re.search(r"PASSWORD|SECRET|REDIS_URL", k))
        assert not secret, f"{secret} belong in a Secret"


def test_configmap_values_parse_as_settings() -> None:
    data = of_kind("ConfigMap")["conveyor"]["data"]
    settings = settings_from(data)  # a value of the wrong type raises here
    fields = {(f.validation_alias if isinstance(f.validation_alias, str) else n).upper(): n
              for n, f in Settings.model_fields.items()}
    ignored = sorted(k for k in data if k in fields and fields[k] not in settings.model_fields_set)
    assert not ignored, f"{ignored} did not reach Settings"


@dataclasses.dataclass
class RedisStart:
    """How a deployment file starts Redis, and what it expects of it."""

    image: str
    argv: list[str]  # sh -c <script>
    env: dict[str, str]
    probe: list[str]
    memory_limit: int | None
    data_mount: str | None
    ports: set[int]  # where clients and probes expect it


def redis_start_k8s() -> RedisStart:
    redis_set = of_kind("StatefulSet")["redis"]
    c = container(redis_set)
    claims = {t["metadata"]["name"] for t in redis_set["spec"].get("volumeClaimTemplates", [])}
    data = [m["mountPath"] for m in c.get("volumeMounts", []) if m["name"] in claims]
    readiness = c["readinessProbe"]["exec"]["command"]
    return RedisStart(c["image"], k8s_argv(c), container_env(c), readiness,
                      quantity(c["resources"]["limits"]["memory"]), data[0] if data else None,
                      {p["containerPort"] for p in c.get("ports", [])})


def redis_start_compose() -> RedisStart:
    service = compose_services()["redis"]
    dotenv = {"REDIS_PASSWORD": PASSWORD}
    argv = [interpolate(a, dotenv) for a in as_argv(service["command"])]
    limit = service.get("deploy", {}).get("resources", {}).get("limits", {}).get("memory") or service.get("mem_limit")
    data = [target for target, source in compose_mounts(service).items() if not source.startswith((".", "/"))]
    probe = [interpolate(a, dotenv) for a in healthcheck_argv(service["healthcheck"]["test"])]
    return RedisStart(service["image"], argv, compose_env(service, dotenv), probe,
                      quantity(limit) if limit else None, data[0] if data else None, {REDIS_DEFAULT_PORT})


def answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


@pytest.mark.parametrize("start", [redis_start_k8s, redis_start_compose], ids=["kubernetes", "compose"])
def test_redis_starts_persistent_capped_and_locked(start: Callable[[], RedisStart]) -> None:
    """The files' own start script, run with a real redis-server (on a unix socket instead of its port)."""
    spec = start()
    assert redis_image_major(spec.image) >= 7, "KEDA's lag mode reads XINFO GROUPS `lag`, which Redis 7 added"
    server = redis_binary()
    cli_bin = Path(server).with_name("redis-cli")
    if not cli_bin.exists():
        found = shutil.which("redis-cli")
        if found is None:
            pytest.skip("no redis-cli")
        cli_bin = Path(found)
    password = spec.env["REDIS_PASSWORD"]
    with tempfile.TemporaryDirectory(prefix="redis-") as tmp:  # short: unix socket paths are limited
        work = Path(tmp)
        sock, data, args_file, bin_dir = work / "s", work / "data", work / "args", work / "bin"
        data.mkdir()
        bin_dir.mkdir()
        (bin_dir / "redis-server").write_text(
            f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {args_file}\n"
            f"exec {server} \"$@\" --port 0 --unixsocket {sock} --unixsocketperm 700 --dir {data}\n")
        (bin_dir / "redis-cli").write_text(f"#!/bin/sh\nexec {cli_bin} -s {sock} \"$@\"\n")
        for f in bin_dir.iterdir():
            f.chmod(0o755)
        path_env = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
        with (work / "log").open("w") as log:  # in a session of its own: nothing it starts outlives the test
            proc = subprocess.Popen(spec.argv, env=spec.env | path_env, cwd=data, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            client = redis.Redis(unix_socket_path=str(sock), password=password, decode_responses=True, retry=NO_RETRY)
            deadline = time.monotonic() + 10
            while not (sock.exists() and answers(client)):
                assert proc.poll() is None and time.monotonic() < deadline, (work / "log").read_text()
                time.sleep(0.05)
            with pytest.raises(redis.AuthenticationError):
                redis.Redis(unix_socket_path=str(sock), retry=NO_RETRY).ping()
            info = client.info("server")
            config = client.config_get("*")
            args = args_file.read_text().splitlines()
            cmdline = Path(f"/proc/{info['process_id']}/cmdline")
            if cmdline.exists():
                assert password.encode() not in cmdline.read_bytes(), "the password shows in `ps`"
            assert password not in args
            # redis-server is the main process (exec): it gets the SIGTERM and shuts down cleanly
            assert info["process_id"] == proc.pid
            assert config["appendonly"] == "yes"
            assert config["maxmemory-policy"] == "noeviction"
            assert int(config["maxmemory"]) > 0, "no memory cap"
            if spec.memory_limit is not None:  # refuse writes before the kernel kills it
                assert int(config["maxmemory"]) < spec.memory_limit
            assert "--dir" not in args and spec.data_mount == REDIS_IMAGE_WORKDIR, "the data is not on the volume"
            assert redis_listen_port(redis_script(spec.argv)) in spec.ports
            ok = subprocess.run(spec.probe, env=spec.env | path_env, capture_output=True, timeout=30)
            assert ok.returncode == 0, ok.stderr
            wrong = subprocess.run(spec.probe, env=spec.env | path_env | {"REDIS_PASSWORD": "wrong"},
                                   capture_output=True, timeout=30)
            assert wrong.returncode != 0, "the probe passes without the password"
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(10)


def test_disruption_budgets() -> None:
    """The API and the pools have budgets, each selecting one workload; at every replica count they allow,
    a node drain can proceed without taking all replicas at once."""
    protected = {}
    for pdb in of_kind("PodDisruptionBudget").values():
        [target] = [w for w in workloads() if selects(pdb["spec"]["selector"], pod_labels(w))]
        protected[target] = pdb["spec"]
    assert set(protected) == {"api", *names.POOLS}
    scaled = {o["spec"]["scaleTargetRef"]["name"]: o["spec"] for o in of_kind("ScaledObject").values()}
    for name, spec in protected.items():
        if name in scaled:
            counts = range(max(scaled[name].get("minReplicaCount", 0), 1), scaled[name]["maxReplicaCount"] + 1)
        else:
            fixed = workloads()[name]["spec"].get("replicas", 1)
            counts = range(fixed, fixed + 1)
        for n in counts:
            assert set(spec) & {"minAvailable", "maxUnavailable"}
            allowed = n - int(spec["minAvailable"]) if "minAvailable" in spec else int(spec["maxUnavailable"])
            assert allowed >= 1, f"{name} at {n}: a node drain never finishes"
            assert allowed < n or n == 1, f"{name} at {n}: a drain may take every replica at once"


def test_replica_counts_are_positive_and_left_to_keda_where_it_scales() -> None:
    scaled = {o["spec"]["scaleTargetRef"]["name"] for o in of_kind("ScaledObject").values()}
    for name, workload in workloads().items():
        replicas = workload["spec"].get("replicas")
        if name in scaled:  # else every `kubectl apply` resets what KEDA chose
            assert replicas is None, name
        elif replicas is not None:
            assert isinstance(replicas, int) and replicas >= 1, name
    for name, service in compose_services().items():
        replicas = service.get("deploy", {}).get("replicas")
        if replicas is not None:
            assert isinstance(replicas, int) and replicas >= 1, name


def test_celery_beat_never_runs_twice() -> None:
    beats = [n for n, c, init in app_containers() if not init and process_of(k8s_argv(c)) == "celery-beat"]
    assert beats
    scaled = {o["spec"]["scaleTargetRef"]["name"] for o in of_kind("ScaledObject").values()}
    for name in beats:
        spec = workloads()[name]["spec"]
        assert spec.get("replicas", 1) == 1 and name not in scaled
        assert spec.get("strategy", {}).get("type") == "Recreate", "a rolling update overlaps two beats"
    for name, service in built_services().items():
        if process_of(compose_argv(service)) == "celery-beat":
            assert service.get("deploy", {}).get("replicas", 1) == 1, name


# ---- KEDA --------------------------------------------------------------------------------------------


def cluster_settings(workload: str) -> Settings:
    return settings_from(container_env(container(workloads()[workload])))


def local_policies(settings: Settings) -> dict[str, PoolPolicy]:
    """What the local autoscaler runs with this configuration, within shared/policy.py's default bounds."""
    bounds = {pool: (p.min_replicas, p.max_replicas) for pool, p in DEFAULT_POLICIES.items()}
    return policies_for(settings, bounds)


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
        assert (meta["stream"], meta["consumerGroup"]) == POOL_STREAMS[pool]  # what the local autoscaler reads
        host, _, port_text = meta["address"].rpartition(":")
        workload, port = service_backend(host, int(port_text))
        assert workload == "redis"
        pool_url = urlsplit(cluster_settings(pool).redis_url)
        assert int(meta.get("databaseIndex", "0")) == int(pool_url.path.strip("/") or 0)
        assert trigger["authenticationRef"]["name"] in auths


def keda_wants(spec: dict[str, Any], metric: float, current: int) -> int:
    """The replicas a ScaledObject asks for at this metric value: KEDA's activation, then the HPA's
    AverageValue rule (ceil(metric / target), kept within the tolerance), clamped to its bounds."""
    [trigger] = spec["triggers"]
    meta = trigger["metadata"]
    if trigger["type"] == "redis-streams":
        target, activation = float(meta["lagCount"]), float(meta.get("activationLagCount", 0))
    else:
        target, activation = float(meta["targetValue"]), float(meta.get("activationTargetValue", 0))
    low, high = int(spec.get("minReplicaCount", 0)), int(spec["maxReplicaCount"])
    if metric <= activation and low == 0:
        return 0
    wanted = math.ceil(metric / target)
    if current > 0 and abs(metric / (target * current) - 1) <= HPA_TOLERANCE:
        wanted = current
    return min(max(wanted, low, 1), high)


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


# ---- secrets -----------------------------------------------------------------------------------------


def ignored_by_git(path: str) -> bool:
    if (ROOT / ".git").exists() and shutil.which("git"):
        return subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT, timeout=30).returncode == 0
    return path in (ROOT / ".gitignore").read_text().splitlines()


def secret_references() -> dict[str, set[str]]:
    """{secret: keys} that pods and KEDA read."""
    refs: dict[str, set[str]] = {}
    for name in workloads():
        for c in all_containers(pod_spec(name)):
            for e in c.get("env", []):
                if "valueFrom" in e:
                    ref = e["valueFrom"]["secretKeyRef"]
                    refs.setdefault(ref["name"], set()).add(ref["key"])
    for auth in of_kind("TriggerAuthentication").values():
        for ref in auth["spec"]["secretTargetRef"]:
            refs.setdefault(ref["name"], set()).add(ref["key"])
    return refs


def test_the_redis_password_is_generated_never_committed(tmp_path: Path) -> None:
    assert "Secret" not in {d["kind"] for d in DOCS}
    refs = secret_references()
    generators = {gen["name"]: gen for gen in KUSTOMIZATION["secretGenerator"]}
    assert set(refs) <= set(generators)
    referenced_by_crds = {r["name"] for a in of_kind("TriggerAuthentication").values()
                          for r in a["spec"]["secretTargetRef"]}
    text = (K8S / "kustomization.yaml").read_text()
    for name, gen in generators.items():
        if name in referenced_by_crds:  # kustomize does not rewrite references inside custom resources
            assert gen["options"]["disableNameSuffixHash"] is True, name
        for env_file in gen["envs"]:
            path = (K8S / env_file).relative_to(ROOT).as_posix()
            assert ignored_by_git(path), f"{path} is not git-ignored"
            made = run_documented_step(documented_step(text, path), tmp_path / "k8s", path)
            assert refs.get(name, set()) <= set(made), f"the documented step makes {sorted(made)}"
            for value in made.values():  # it goes into REDIS_URL as is
                assert len(value) >= 32 and quote(value, safe="") == value
    compose_text = (ROOT / "docker-compose.yml").read_text()
    required = set(re.findall(r"\$\{(\w+):?\?", compose_text))
    assert ignored_by_git(".env")
    made = run_documented_step(documented_step(compose_text, ".env"), tmp_path / "compose", ".env")
    assert required <= set(made), f"compose needs {sorted(required)}, the documented step makes {sorted(made)}"
    again = run_documented_step(documented_step(compose_text, ".env"), tmp_path / "compose", ".env")
    assert again == made, "running the step again changes the password of an existing Redis volume"
    if (ROOT / ".git").exists():
        tracked = subprocess.run(["git", "ls-files", "infra/k8s", ".env"], cwd=ROOT, capture_output=True, text=True)
        assert tracked.returncode == 0
        leaked = [f for f in tracked.stdout.splitlines() if f.endswith(".env")]
        assert not leaked, leaked
    for path in [*K8S.glob("*.yaml"), ROOT / "docker-compose.yml"]:
        content = path.read_text()
        assert "change-me" not in content, path
        assert not re.search(r"redis://:[^$@]+@", content), f"{path}: a password in a URL"
        assert not re.search(r"requirepass +[^$\s]", content), f"{path}: a literal requirepass"
    for name in workloads():
        for c in all_containers(pod_spec(name)):
            for e in c.get("env", []):
                if re.search(r"PASSWORD|SECRET", e["name"]):
                    assert "secretKeyRef" in e.get("valueFrom", {}), f"{name}: {e['name']} not from a Secret"


def test_the_api_requires_keys() -> None:
    """The API reachable from outside (the cluster's, and compose's published port) asks for keys."""
    api = cluster_settings("api")
    assert api.auth_required and api.internal_port_number != api.port
    compose_api = settings_from(compose_env(compose_services()["api"], {"REDIS_PASSWORD": PASSWORD}))
    assert compose_api.auth_required, "compose publishes the API's port"


# ---- lockdown ----------------------------------------------------------------------------------------


def pinned(image: str) -> bool:
    """A full version tag (x.y.z...) or a digest: the same reference always runs the same code."""
    if not re.fullmatch(r"[\w.\-/]+:[\w.\-]+(@sha256:[0-9a-f]{64})?", image):
        return False
    tag = image.split("@")[0].rsplit(":", 1)[1]
    return "@sha256:" in image or (tag != "latest" and tag.count(".") >= 2)


def test_every_pod_is_locked_down() -> None:
    user = instructions("USER")[-1]
    app_images = set()
    for name, workload in workloads().items():
        pod = workload["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False, name
        volumes = {v["name"] for v in pod.get("volumes", [])} | {
            t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
        for c in all_containers(pod):
            sc, where = c["securityContext"], f"{name}/{c['name']}"
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert sc.get("runAsNonRoot", pod["securityContext"].get("runAsNonRoot")) is True, where
            assert pinned(c["image"]), f"{where}: {c['image']} unpinned"
            assert {m["name"] for m in c.get("volumeMounts", [])} <= volumes, where
            if is_app_image(c["image"]):
                app_images.add(c["image"])
                run_as = sc.get("runAsUser", pod["securityContext"].get("runAsUser"))
                # the kubelet checks runAsNonRoot against a numeric user only; the image's home is that user's
                assert run_as is not None or (user.isdigit() and int(user) > 0), where
                assert run_as is None or str(run_as) == user, f"{where} runs as {run_as}, the image as {user}"
    assert len(app_images) == 1, f"every process runs the same build: {app_images}"
    [app_image] = app_images
    used = {c["image"].split(":")[0] for n in workloads() for c in all_containers(pod_spec(n))}
    for override in KUSTOMIZATION.get("images", []):  # `kubectl apply -k` deploys the tag the files name
        assert override["name"] in used, f"the kustomization retags {override['name']}, which nothing runs"
        if is_app_image(override["name"]):
            assert f"{override.get('newName', override['name'])}:{override['newTag']}" == app_image


# ---- network policies --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Peer:
    """A pod (a namespace and labels) or an address outside the cluster (no namespace)."""

    name: str
    ip: str
    namespace: str | None = None
    labels: tuple[tuple[str, str], ...] = ()


NETWORK_POLICIES = of_kind("NetworkPolicy")
PODS = {name: Peer(name, f"10.244.0.{10 + i}", NAMESPACE, tuple(sorted(pod_labels(name).items())))
        for i, name in enumerate(sorted(workloads()))}
# the namespaces the policies expect KEDA and Prometheus in (networkpolicy.yaml)
KEDA = Peer("keda", "10.244.1.10", "keda", (("app", "keda-operator"),))
PROMETHEUS = Peer("prometheus", "10.244.1.11", "monitoring", (("app.kubernetes.io/name", "prometheus"),))
KUBE_DNS = Peer("kube-dns", "10.96.0.10", "kube-system", (("k8s-app", "kube-dns"),))
LOOKALIKE = Peer("lookalike", "10.244.1.12", "default", PODS[names.TOKENIZER_POOL].labels)  # same labels, elsewhere
PUBLIC = [Peer("public-v4", "1.1.1.1"), Peer("public-v6", "2606:4700:4700::1111")]
NON_PUBLIC = [Peer(f"non-public {ip}", ip) for ip in (
    "10.0.0.1", "10.255.255.254", "172.16.0.1", "172.31.255.254", "192.168.0.1", "192.168.255.254",
    "169.254.169.254", "127.0.0.1", "100.64.0.1", "100.127.255.254", "0.0.0.1", "224.0.0.251",
    "::1", "fe80::1", "fd00::1", "fd00:ec2::254", "::ffff:10.0.0.1", "::ffff:169.254.169.254", "64:ff9b::a9fe:a9fe")]
OUTSIDERS = [KEDA, PROMETHEUS, KUBE_DNS, LOOKALIKE, *PUBLIC, *NON_PUBLIC]


def is_public(ip: str) -> bool:
    """A global unicast address; a NAT64 address (64:ff9b::/96) is as public as the IPv4 address it carries."""
    address = ipaddress.ip_address(ip)
    if isinstance(address, ipaddress.IPv6Address) and address in ipaddress.ip_network("64:ff9b::/96"):
        return is_public(str(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)))
    return address.is_global and not address.is_multicast


def peer_matches(rule_peer: dict[str, Any], peer: Peer) -> bool:
    if "ipBlock" in rule_peer:
        block, address = rule_peer["ipBlock"], ipaddress.ip_address(peer.ip)
        within = [n for n in map(ipaddress.ip_network, [block["cidr"]]) if n.version == address.version]
        excepted = [n for n in map(ipaddress.ip_network, block.get("except", [])) if n.version == address.version]
        return any(address in n for n in within) and not any(address in n for n in excepted)
    if peer.namespace is None:
        return False
    namespace_selector = rule_peer.get("namespaceSelector")
    in_namespace = (peer.namespace == NAMESPACE if namespace_selector is None
                    else selects(namespace_selector, {"kubernetes.io/metadata.name": peer.namespace}))
    pod_selector = rule_peer.get("podSelector")
    return in_namespace and (pod_selector is None or selects(pod_selector, dict(peer.labels)))


def port_matches(rule: dict[str, Any], protocol: str, port: int) -> bool:
    for p in rule.get("ports") or [{}]:
        assert not isinstance(p.get("port"), str), "named ports are not modelled here"
        low = p.get("port")
        if p.get("protocol", "TCP") == protocol and (low is None or low <= port <= p.get("endPort", low)):
            return True
    return False


def policy_types(policy: dict[str, Any]) -> list[str]:
    spec = policy["spec"]
    return list(spec.get("policyTypes") or ["Ingress", *(["Egress"] if "egress" in spec else [])])


def isolating(pod: Peer, direction: str) -> list[dict[str, Any]]:
    """The policies that select this pod for `direction` ("Ingress" or "Egress"); none: all is allowed."""
    if pod.namespace != NAMESPACE:
        return []
    return [p for p in NETWORK_POLICIES.values()
            if direction in policy_types(p) and selects(p["spec"]["podSelector"], dict(pod.labels))]


def allows(pod: Peer, direction: str, other: Peer, protocol: str, port: int) -> bool:
    policies = isolating(pod, direction)
    key, peers = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    return not policies or any(
        (not rule.get(peers) or any(peer_matches(p, other) for p in rule[peers])) and port_matches(rule, protocol, port)
        for policy in policies for rule in policy["spec"].get(key, []))


def reachable(src: Peer, dst: Peer, port: int, protocol: str = "TCP") -> bool:
    return allows(src, "Egress", dst, protocol, port) and allows(dst, "Ingress", src, protocol, port)


def api_ports() -> tuple[int, int]:
    api = cluster_settings("api")
    return api.port, api.internal_port_number


def redis_port() -> int:
    return redis_listen_port(redis_script(k8s_argv(container(workloads()["redis"]))))


def app_workloads() -> set[str]:
    return {name for name, _, _ in app_containers()}


def needed_flows() -> set[tuple[str, str, str, int]]:
    """(source, destination, protocol, port) that the processes need, beyond DNS."""
    public, internal = api_ports()
    flows = {(name, "redis", "TCP", redis_port()) for name in app_workloads()}
    for obj in of_kind("ScaledObject").values():
        [trigger] = obj["spec"]["triggers"]
        if trigger["type"] == "redis-streams":
            flows.add((KEDA.name, "redis", "TCP", redis_port()))
        else:
            url = urlsplit(trigger["metadata"]["url"])
            workload, port = service_backend(str(url.hostname), int(url.port or 80))
            flows.add((KEDA.name, workload, "TCP", port))
    flows.add((PROMETHEUS.name, "api", "TCP", internal))  # /metrics
    for outsider in OUTSIDERS:  # the API is open to anyone, behind its keys
        flows.add((outsider.name, "api", "TCP", public))
    for peer in PUBLIC:
        flows |= {("celery-worker", peer.name, "TCP", port) for port in (80, 443)}  # webhooks
        flows |= {(pool, peer.name, "TCP", 443) for pool in names.POOLS}  # the model-pull init container
    return flows


def probe_ports() -> list[tuple[str, int]]:
    ports = {p["containerPort"] for name in workloads() for c in all_containers(pod_spec(name))
             for p in c.get("ports", [])}
    ports |= {p["port"] for policy in NETWORK_POLICIES.values() for key in ("ingress", "egress")
              for rule in policy["spec"].get(key, []) for p in rule.get("ports", [])}
    return [("TCP", port) for port in sorted(ports | {22, 53, 80, 443, 6379, 8000, 8001, 9090})] + [("UDP", 53)]


def test_network_policies_deny_by_default() -> None:
    """Every pod is isolated both ways, and nothing is reachable beyond what the processes need (DNS aside)."""
    for name, pod in PODS.items():
        assert isolating(pod, "Ingress") and isolating(pod, "Egress"), f"{name} is not isolated"
    for policy in NETWORK_POLICIES.values():  # no rule opens every port
        for key in ("ingress", "egress"):
            assert all(rule.get("ports") for rule in policy["spec"].get(key, [])), policy["metadata"]["name"]
    needed = needed_flows()
    extra = []
    for src in [*PODS.values(), *OUTSIDERS]:
        for dst in [*PODS.values(), *OUTSIDERS]:
            if NAMESPACE not in (src.namespace, dst.namespace) or src == dst:
                continue
            for protocol, port in probe_ports():
                dns = port == 53 and src.name in PODS  # every pod resolves names, with any resolver
                flow = (src.name, dst.name, protocol, port)
                if not dns and flow not in needed and reachable(src, dst, port, protocol):
                    extra.append(flow)
    assert not extra, f"open beyond what the processes need: {extra[:12]}"
    for pod in PODS.values():
        assert reachable(pod, KUBE_DNS, 53, "UDP") and reachable(pod, KUBE_DNS, 53, "TCP"), pod.name


def test_network_policies_let_only_conveyor_and_keda_reach_redis() -> None:
    port, redis = redis_port(), PODS["redis"]
    for name in app_workloads():
        assert reachable(PODS[name], redis, port), name
    keda_reads_redis = any(o["spec"]["triggers"][0]["type"] == "redis-streams"
                           for o in of_kind("ScaledObject").values())
    assert reachable(KEDA, redis, port) == keda_reads_redis
    for outsider in [LOOKALIKE, PROMETHEUS, *PUBLIC, *NON_PUBLIC]:
        assert not reachable(outsider, redis, port), outsider.name
    for dst in [*PODS.values(), *PUBLIC, *NON_PUBLIC, KEDA]:  # redis itself starts nothing
        assert not any(reachable(redis, dst, p, proto) for proto, p in probe_ports() if p != 53), dst.name


def test_network_policies_open_the_api_port_and_keep_the_internal_one_for_monitoring() -> None:
    public, internal = api_ports()
    api = PODS["api"]
    for outsider in [*PUBLIC, LOOKALIKE, PROMETHEUS]:
        assert reachable(outsider, api, public), outsider.name
    for outsider in [*PUBLIC, LOOKALIKE]:
        assert not reachable(outsider, api, internal), outsider.name
    assert reachable(PROMETHEUS, api, internal)
    assert reachable(KEDA, api, internal) == any(
        o["spec"]["triggers"][0]["type"] == "metrics-api" for o in of_kind("ScaledObject").values())
    for name in app_workloads() - {"api"}:  # nothing reaches the workers
        for src in [*PODS.values(), *OUTSIDERS]:
            assert not any(reachable(src, PODS[name], p, proto) for proto, p in probe_ports()), (src.name, name)


def test_network_policies_let_celery_reach_only_public_addresses() -> None:
    for peer in [*PUBLIC, *NON_PUBLIC]:  # the samples are what they claim to be
        assert is_public(peer.ip) == (peer in PUBLIC), peer.ip
    celery = PODS["celery-worker"]
    for peer in PUBLIC:
        assert reachable(celery, peer, 443) and reachable(celery, peer, 80), peer.name
        assert not reachable(celery, peer, 22)
        for pool in names.POOLS:  # the model pull, over HTTPS only
            assert reachable(PODS[pool], peer, 443) and not reachable(PODS[pool], peer, 80), pool
    for name, pod in PODS.items():
        for peer in NON_PUBLIC:  # private ranges, loopback, link-local (cloud metadata), ...
            assert not any(reachable(pod, peer, p) for p in (80, 443)), (name, peer.ip)
        if name not in {"celery-worker", *names.POOLS}:
            assert not any(reachable(pod, peer, p) for peer in PUBLIC for p in (80, 443)), name


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl")
def test_kustomize_builds_and_validates(tmp_path: Path) -> None:
    build = tmp_path / "k8s"
    shutil.copytree(K8S, build, ignore=shutil.ignore_patterns(*(e for g in KUSTOMIZATION["secretGenerator"]
                                                                for e in g["envs"])))
    refs = secret_references()
    for gen in KUSTOMIZATION["secretGenerator"]:
        for env_file in gen["envs"]:
            (build / env_file).write_text("".join(f"{key}={PASSWORD}\n" for key in sorted(refs[gen["name"]])))
    out = subprocess.run(["kubectl", "kustomize", str(build)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    for doc in docs:
        if doc["kind"] in CORE_KINDS:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        assert doc["kind"] == "Namespace" or doc["metadata"]["namespace"] == NAMESPACE
    secrets = {d["metadata"]["name"]: set(d["data"]) for d in docs if d["kind"] == "Secret"}
    assert secrets == refs  # the generated names are the ones pods and KEDA read
    source_images = {c["image"] for n in workloads() for c in all_containers(pod_spec(n))}
    built_images = {c["image"] for d in docs if d["kind"] in ("Deployment", "StatefulSet")
                    for c in all_containers(d["spec"]["template"]["spec"])}
    assert built_images == source_images and all(pinned(i) for i in built_images)


# ---- docker compose ----------------------------------------------------------------------------------


def docker_compose_available() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode == 0


@pytest.mark.skipif(not docker_compose_available(), reason="no docker compose")
def test_compose_is_valid_for_docker_compose(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in {"REDIS_PASSWORD", "COMPOSE_FILE", "COMPOSE_PROFILES"}}
    base = ["docker", "compose", "--project-directory", str(ROOT), "-f", str(ROOT / "docker-compose.yml")]
    empty, dotenv = tmp_path / "empty.env", tmp_path / ".env"
    empty.write_text("")
    dotenv.write_text(f"REDIS_PASSWORD={PASSWORD}\n")
    for profile in ([], ["--profile", "cpu"]):
        ok = subprocess.run([*base, "--env-file", str(dotenv), *profile, "config", "-q"], env=env,
                            capture_output=True, text=True, timeout=120)
        assert ok.returncode == 0, ok.stderr
    refused = subprocess.run([*base, "--env-file", str(empty), "config", "-q"], env=env, capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode != 0 and "REDIS_PASSWORD" in refused.stderr


def test_compose_file_is_consistent() -> None:
    services = compose_services()
    volumes = set(COMPOSE.get("volumes") or {})
    for name, service in services.items():
        assert "image" in service or "build" in service, name
        if "build" in service:
            build = service["build"] if isinstance(service["build"], dict) else {"context": service["build"]}
            assert (ROOT / build["context"] / build.get("dockerfile", "Dockerfile")).is_file(), name
        if is_app_image(service.get("image", "")):
            assert "build" in service, f"{name}: built here, never pulled"
        for dep, condition in depends_on(service).items():
            assert dep in services, f"{name} waits for no service {dep}"
            assert not services[dep].get("profiles") or service.get("profiles"), f"{name} waits for a profiled {dep}"
            if condition == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep}'s health, which it never reports"
            if condition == "service_completed_successfully":
                assert str(services[dep].get("restart", "no")) in ("no", "on-failure"), f"{dep} never completes"
        for source in compose_mounts(service).values():
            if not source.startswith((".", "/")):
                assert source in volumes, f"{name}: volume {source} is not declared"
    assert len({s["image"] for s in built_services().values()}) == 1, "every process runs the same build"


def test_compose_services_and_commands() -> None:
    """Each compose service runs the process it is named for, and `docker compose up` runs what the cluster runs."""
    cluster = {process_of(k8s_argv(c)) for _, c, _ in app_containers()}
    default = set()
    for name, service in built_services().items():
        process = process_of(compose_argv(service))
        assert name == process or name.startswith(f"{process}-"), f"{name} runs {process}"
        if service.get("profiles"):
            assert process in cluster, f"{name}: a variant of no cluster process"
        else:
            default.add(process)
    assert default == cluster  # `docker compose up` runs what the cluster runs


def test_compose_environment_and_health() -> None:
    services = compose_services()
    dotenv = {"REDIS_PASSWORD": PASSWORD}
    model_volumes = set()
    for name, service in built_services().items():
        settings = settings_from(compose_env(service, dotenv))
        process = process_of(compose_argv(service))
        model_volumes.add(compose_volume_at(service, settings.model_path))
        assert compose_volume_at(service, settings.cache_dir), f"{name}: the cache is not on a volume"
        if process != "model-pull":
            url = urlsplit(settings.redis_url)
            assert url.hostname in services and unquote(url.password or "") == PASSWORD, name
            redis_service = services[url.hostname]
            assert redis_image_major(redis_service["image"]) >= 7
            assert depends_on(service).get(url.hostname) == "service_healthy", f"{name} starts before Redis"
            assert url.port == redis_listen_port(redis_script(as_argv(redis_service["command"])))
        health = service.get("healthcheck")
        if process == "api":
            [target] = [int(str(p).split(":")[-1]) for p in service.get("ports", [])]
            assert target == settings.port and not is_loopback(settings.host)
            assert health, "api has no healthcheck"
            [url_text] = re.findall(r"https?://[^'\"\s]+", " ".join(healthcheck_argv(health["test"])))
            probe = urlsplit(url_text)
            assert api_serves(probe.path) and probe.port == settings.port
        elif process in names.POOLS:
            assert health, f"{name} has no healthcheck"
            args = conveyor_args(healthcheck_argv(health["test"])[1:])
            assert (args.cmd, getattr(args, "check", False)) == (process, True), name
    # model-pull fills the volume the workers read
    assert len(model_volumes) == 1 and None not in model_volumes, model_volumes


def test_compose_redis_has_a_password() -> None:
    services = compose_services()
    uses = [str(v) for s in services.values() for v in s.get("environment", {}).values() if "REDIS_PASSWORD" in str(v)]
    assert len(uses) >= 2  # redis-server's and the clients' REDIS_URL
    for value in uses:
        with pytest.raises(ValueError, match="REDIS_PASSWORD"):  # no password: compose refuses to start
            interpolate(value, {})
    redis_env = compose_env(services["redis"], {"REDIS_PASSWORD": PASSWORD})
    assert redis_env["REDIS_PASSWORD"] == PASSWORD


def test_compose_gpu_and_cpu_inference() -> None:
    dotenv = {"REDIS_PASSWORD": PASSWORD}
    inference = {n: s for n, s in built_services().items() if process_of(compose_argv(s)) == names.INFERENCE_POOL}
    gpu = [n for n, s in inference.items() if "deploy" in s]
    assert gpu and len(inference) >= 2
    for name, service in inference.items():
        settings = settings_from(compose_env(service, dotenv))
        assert duration_s(str(service.get("stop_grace_period", "10s"))) > settings.drain_grace_s, name
        if name in gpu:
            [device] = service["deploy"]["resources"]["reservations"]["devices"]
            assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
            assert device.get("count", "all") == "all" or int(device["count"]) >= 1
            assert not service.get("profiles"), "the GPU service runs by default"
        else:  # the CPU variant: no GPU to reserve, and a dtype a CPU computes
            assert service.get("profiles"), name
            assert settings.device == "cpu" and settings.dtype in ("auto", "float32", "bfloat16"), name


# ---- the image ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Image:
    """What the Dockerfile's `pip install` of the project puts in the image: the wheel of what it copies."""

    files: dict[str, bytes]
    extras: frozenset[str]

    def text(self, name: str) -> str:
        return self.files[name].decode()

    def dist_info(self, name: str) -> str:
        [path] = [f for f in self.files if re.fullmatch(rf"[^/]+\.dist-info/{name}", f)]
        return self.text(path)

    @property
    def metadata(self) -> email.message.Message:
        return email.message_from_string(self.dist_info("METADATA"))

    @property
    def console_scripts(self) -> dict[str, str]:
        section, scripts = "", {}
        for line in self.dist_info("entry_points.txt").splitlines():
            if line.startswith("["):
                section = line.strip().strip("[]")
            elif section == "console_scripts" and "=" in line:
                name, _, target = line.partition("=")
                scripts[name.strip()] = target.strip()
        return scripts


def dockerignored(rel: str) -> bool:
    ignore = ROOT / ".dockerignore"
    if not ignore.exists():
        return False
    patterns = [p.strip().strip("/") for p in ignore.read_text().splitlines() if p.strip() and p[0] not in "#!"]
    return any(fnmatch(rel, p) or fnmatch(rel, f"{p}/*") for p in patterns)


def replay_copies(into: Path) -> tuple[Path, frozenset[str]]:
    """Replay the Dockerfile's WORKDIR and COPY lines into `into` (the image's /) up to its `pip install`
    of the project; return the directory pip installs and the extras it asks for."""
    workdir = "/"
    for ins in DOCKERFILE:
        if ins.keyword == "WORKDIR":
            workdir = posixpath.join(workdir, ins.value)
        elif ins.keyword in ("COPY", "ADD"):
            words = json.loads(ins.value) if ins.value.startswith("[") else shlex.split(ins.value)
            assert not any(w.startswith("--from") for w in words), "multi-stage builds are not replayed"
            *sources, dest = [w for w in words if not w.startswith("--")]
            target = into / posixpath.join(workdir, dest).lstrip("/")
            for pattern in sources:
                matches = sorted(p for p in ROOT.glob(pattern) if not dockerignored(p.relative_to(ROOT).as_posix()))
                assert matches, f"{ins.keyword} {pattern}: not in the build context"
                for src in matches:
                    if src.is_dir():
                        shutil.copytree(src, target, dirs_exist_ok=True, ignore=lambda d, found: [
                            f for f in found if f == "__pycache__"
                            or dockerignored((Path(d) / f).relative_to(ROOT).as_posix())])
                    else:
                        to = target / src.name if dest.endswith("/") or len(matches) > 1 else target
                        to.parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(src, to)
        elif ins.keyword == "RUN":
            for found in re.finditer(r"\bpip install\b([^;&|]*)", ins.value):
                local = [w for w in shlex.split(found.group(1)) if w.startswith((".", "/"))]
                if local:
                    path, _, extras = local[0].partition("[")
                    project = into / posixpath.join(workdir, path).lstrip("/")
                    return project, frozenset(e.strip() for e in extras.rstrip("]").split(",") if e.strip())
    raise AssertionError("the Dockerfile never installs the project")


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Image:
    root = tmp_path_factory.mktemp("image")
    project, extras = replay_copies(root / "fs")
    out = root / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "--quiet",
         "-w", str(out), str(project)],
        capture_output=True, text=True, timeout=600, env=os.environ | {"PIP_NO_INPUT": "1"})
    assert build.returncode == 0, build.stdout + build.stderr
    [wheel] = out.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        return Image({n: z.read(n) for n in z.namelist()}, extras)


FIRST_PARTY = frozenset({p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
                        | {p.stem for p in ROOT.glob("*.py")})
MODULE_REFERENCE = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?::[A-Za-z_]\w*)?")  # "api.main:app"


def source_module(name: str) -> bool:
    base = ROOT / name.replace(".", "/")
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def module_file(name: str, files: Mapping[str, bytes]) -> str | None:
    base = name.replace(".", "/")
    return next((f for f in (f"{base}.py", f"{base}/__init__.py") if f in files), None)


def run_time_imports(module: str, source: str, is_package: bool) -> tuple[set[str], set[str]]:
    """(first-party modules, third-party top-level names) a module imports when it runs: imports under
    `if TYPE_CHECKING:` and in `try: ... except ImportError:` are left out, and strings naming a module
    of ours ("api.main:app", for uvicorn) count as imports."""
    tree = ast.parse(source)
    skipped: set[int] = set()
    for node in ast.walk(tree):
        body: list[ast.stmt] = []
        if isinstance(node, ast.Try) and any(
                h.type is not None and {"ImportError", "ModuleNotFoundError"} & {
                    n.id for n in ast.walk(h.type) if isinstance(n, ast.Name)} for h in node.handlers):
            body = node.body
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            body = node.body
        skipped |= {id(n) for stmt in body for n in ast.walk(stmt)}
    package = module if is_package else module.rpartition(".")[0]
    ours: set[str] = set()
    theirs: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        required: list[str] = []
        maybe: list[str] = []
        if isinstance(node, ast.Import):
            required = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], *([node.module] if node.module else [])])
            required, maybe = [base], [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if found := MODULE_REFERENCE.fullmatch(node.value):
                maybe = [found.group(1)]
        for name in required + [m for m in maybe if source_module(m)]:
            top = name.split(".")[0]
            if top in FIRST_PARTY:
                ours.add(name)
            elif name in required and top not in sys.stdlib_module_names and top != "__future__":
                theirs.add(top)
    return ours, theirs


def entry_modules(image: Image) -> set[str]:
    """The modules the processes start from: the console script's, and each `celery -A` app."""
    commands = [k8s_argv(c) for _, c, _ in app_containers()] + [compose_argv(s) for s in built_services().values()]
    modules = {image.console_scripts[CONVEYOR].split(":")[0]}
    modules |= {celery_parts(argv)[0] for argv in commands if argv[0] == "celery"}
    return modules


def load_closure(image: Image) -> tuple[set[str], set[str], set[str]]:
    """(modules of ours the processes load, those the image lacks, third-party names they import)."""
    todo, seen, missing, theirs = sorted(entry_modules(image)), set(), set(), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        path = module_file(name, image.files)
        if path is None:
            missing.add(name)
            continue
        ours, imported = run_time_imports(name, image.text(path), path.endswith("__init__.py"))
        todo += sorted(ours)
        theirs |= imported
    return seen, missing, theirs


def installed_closure(roots: Iterable[Requirement], extras: frozenset[str]) -> set[str]:
    """The distributions pip installs for these requirements (as this environment resolved them)."""
    todo = [(r.name, frozenset(r.extras)) for r in roots
            if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in {"", *extras})]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, wanted = todo.pop()
        key = (canonicalize_name(name), wanted)
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = importlib.metadata.distribution(name).requires or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in {"", *wanted}):
                todo.append((req.name, frozenset(req.extras)))
    return {name for name, _ in seen}


def image_distributions(image: Image) -> set[str]:
    """The project's requirements with the Dockerfile's extras, and the torch it installs first."""
    roots = [Requirement(r) for r in image.metadata.get_all("Requires-Dist") or []]
    roots.append(Requirement(DOCKER_ARGS["TORCH_SPEC"]))
    return installed_closure(roots, image.extras)


def test_the_image_builds_its_entrypoint(image: Image) -> None:
    """The wheel declares the ENTRYPOINT's console script, pointing at a function that takes no arguments;
    the extras installed exist and the base image's Python satisfies requires-python."""
    scripts = image.console_scripts
    assert CONVEYOR in scripts, f"the wheel declares {sorted(scripts)}, the ENTRYPOINT runs {CONVEYOR}"
    module, _, function = scripts[CONVEYOR].partition(":")
    path = module_file(module, image.files)
    assert path, f"{scripts[CONVEYOR]}: no {module} in the image"
    functions = {n.name: n for n in ast.parse(image.text(path)).body if isinstance(n, ast.FunctionDef)}
    assert function in functions, f"{scripts[CONVEYOR]}: no function {function} in {path}"
    arguments = functions[function].args
    assert len(arguments.args) == len(arguments.defaults), "a console script calls it without arguments"
    assert image.extras <= set(image.metadata.get_all("Provides-Extra") or []), "pip install asks for no such extra"
    [base] = instructions("FROM")
    python = re.match(r"python:(\d+\.\d+)", base)
    assert python, f"{base}: not a python image"
    assert SpecifierSet(image.metadata["Requires-Python"] or "").contains(python.group(1))


def test_the_image_holds_every_module_and_file_the_processes_load(image: Image) -> None:
    """Every module the entry points import at run time, the dashboard's files and the Lua scripts."""
    loaded, missing, _ = load_closure(image)
    assert {"api.main", "workers.celery_app", "gpu_worker.worker"} <= loaded  # reached through the entry points
    assert not missing, f"imported at run time, absent from the image: {sorted(missing)}"
    # the dashboard's page and everything it links (GET /dashboard, /dashboard/static/...)
    page = image.text("api/static/dashboard.html")
    assets = re.findall(r"(?:src|href)=\"/dashboard/static/([^\"]+)\"", page)
    assert assets
    for asset in assets:
        assert f"api/static/{asset}" in image.files, asset
    for path in (ROOT / "api" / "static").rglob("*"):
        if path.is_file():
            assert path.relative_to(ROOT).as_posix() in image.files, path
    # the Redis protocol's Lua scripts, each loaded by name when shared.scripts is imported
    scripts = re.findall(r"\bScript\(\"(\w+)\"\)", image.text("shared/scripts/__init__.py"))
    assert scripts
    for name in scripts:
        assert f"shared/scripts/{name}.lua" in image.files, name
    for path in (ROOT / "shared" / "scripts").glob("*.lua"):
        assert path.relative_to(ROOT).as_posix() in image.files, path


def test_the_image_installs_every_distribution_the_processes_import(image: Image) -> None:
    """Every third-party import is installed by the project's requirements (with the Dockerfile's extras)
    or the torch installed first, and every command the files run is an executable of the image."""
    _, _, imported = load_closure(image)
    installed = image_distributions(image)
    providers = importlib.metadata.packages_distributions()
    absent = sorted(top for top in imported
                    if not any(canonicalize_name(d) in installed for d in providers.get(top, [])))
    assert not absent, f"imported at run time, installed by nothing in the image: {absent}"
    # and every command the files run is on the image's PATH
    executables = set(image.console_scripts) | BASE_IMAGE_EXECUTABLES
    for dist in installed:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            executables |= {e.name for e in importlib.metadata.distribution(dist).entry_points
                            if e.group == "console_scripts"}
    commands = [k8s_argv(c) for _, c, _ in app_containers()] + [compose_argv(s) for s in built_services().values()]
    commands += [healthcheck_argv(s["healthcheck"]["test"]) for s in built_services().values() if "healthcheck" in s]
    commands += [c[kind]["exec"]["command"] for _, c, _ in app_containers()
                 for kind in ("startupProbe", "livenessProbe", "readinessProbe") if "exec" in c.get(kind, {})]
    for argv in commands:
        assert Path(argv[0]).name in executables, f"`{shlex.join(argv)}`: no {argv[0]} in the image"


def makefile_default(name: str) -> str:
    found = re.search(rf"^{name}\s*[?:]?=\s*(.*?)\s*$", (ROOT / "Makefile").read_text(), re.M)
    assert found, f"the Makefile sets no {name}"
    return found.group(1)


def test_the_image_and_the_makefile_install_the_same_torch() -> None:
    spec = DOCKER_ARGS["TORCH_SPEC"]
    assert Requirement(spec).name == "torch"
    assert spec == makefile_default("TORCH_SPEC"), "`make` and `docker build` install different torch"
    for name, service in built_services().items():
        args = service["build"].get("args", {})
        if "TORCH_SPEC" in args:
            assert interpolate(str(args["TORCH_SPEC"]), {}) == spec, name
        if "TORCH_INDEX" in args:
            assert interpolate(str(args["TORCH_INDEX"]), {}) == DOCKER_ARGS["TORCH_INDEX"], name
