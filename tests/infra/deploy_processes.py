"""What the processes the deployment files start run and run with: command lines parsed by the image's own CLIs,
environments resolved into Settings as the kubelet and docker compose resolve them, and Redis as the files
start it."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import importlib.metadata
import io
import math
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from shared.settings import Settings
from tests.infra.deploy_files import (
    CONVEYOR,
    IMAGE_ENV,
    KUSTOMIZATION,
    PASSWORD,
    PROJECT,
    PYPROJECT,
    REDIS_DEFAULT_PORT,
    ROOT,
    as_argv,
    compose_mounts,
    compose_services,
    container,
    healthcheck_argv,
    interpolate,
    is_app_image,
    k8s_argv,
    of_kind,
    pod_spec,
    quantity,
    workloads,
)

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


def celery_command(argv: list[str]) -> list[str] | None:
    """The `celery ...` command line that `conveyor celery ...` runs, or None for another command."""
    return ["celery", *argv[2:]] if argv[:2] == [CONVEYOR, "celery"] else None


def process_of(argv: list[str]) -> str:
    """The process a command line starts, named as workloads are (`api`, `model-pull`, `celery-beat`);
    fails when the image has no such command or refuses its arguments. Every process starts from `conveyor`,
    which handles SIGTERM from its first line: a container's PID 1 drops any signal it has no handler for, and
    Celery installs its own only once started."""
    if celery := celery_command(argv):
        why = celery_refuses(tuple(celery[1:]))
        assert not why, f"`{shlex.join(argv)}`: {why}"
        return f"celery-{celery_parts(celery)[1]}"
    if argv[0] == CONVEYOR:
        args = conveyor_args(argv[1:])
        sub = getattr(args, f"{args.cmd}_cmd", None)
        return f"{args.cmd}-{sub}" if sub else str(args.cmd)
    raise AssertionError(f"`{shlex.join(argv)}`: not a `{CONVEYOR}` command (as its container's PID 1, a SIGTERM "
                         "while it starts would be lost)")


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


def container_env(c: dict[str, Any], config_maps: Mapping[str, dict[str, Any]] | None = None) -> dict[str, str]:
    """A container's environment: the image's ENV, then envFrom, then env in order. config_maps: by name,
    those its envFrom reads (default: the manifests')."""
    env = dict(IMAGE_ENV) if is_app_image(c["image"]) else {}
    maps = of_kind("ConfigMap") if config_maps is None else config_maps
    for source in c.get("envFrom", []):
        assert set(source) == {"configMapRef"}, source
        env.update(maps[source["configMapRef"]["name"]]["data"])
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(str(e["value"]), env)
        elif "resourceFieldRef" in e["valueFrom"]:
            env[e["name"]] = resource_value(c, e["valueFrom"]["resourceFieldRef"])
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = secret_value(ref["name"], ref["key"])
    return env


def resource_value(c: dict[str, Any], ref: dict[str, Any]) -> str:
    """A resourceFieldRef as the kubelet resolves it: the container's CPU request or limit in units of `divisor`,
    rounded up (only CPU here)."""
    assert ref.get("containerName", c["name"]) == c["name"], ref
    kind, _, resource = ref["resource"].partition(".")
    assert resource == "cpu", ref
    quantity = str(c["resources"][{"requests": "requests", "limits": "limits"}[kind]]["cpu"])
    cores = int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)
    divisor = str(ref.get("divisor", "1"))
    unit = int(divisor[:-1]) / 1000 if divisor.endswith("m") else float(divisor)
    return str(math.ceil(cores / unit))


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


def compose_env(service: dict[str, Any], dotenv: Mapping[str, str]) -> dict[str, str]:
    env = service.get("environment", {})
    assert isinstance(env, dict), "environment as a mapping"
    base = dict(IMAGE_ENV) if "build" in service else {}
    return base | {k: interpolate(str(v), dotenv) for k, v in env.items()}


def cluster_settings(workload: str) -> Settings:
    return settings_from(container_env(container(workloads()[workload])))


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


# ---- Redis, as the files start it --------------------------------------------------------------------


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
