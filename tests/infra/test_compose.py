"""docker-compose.yml passes `docker compose config` where the compose plugin is installed (and a structural
check always), and runs the processes the cluster runs, with settings, health checks and a Redis password that
work."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from shared import names
from shared.lifecycle import worker_stop_s
from shared.settings import is_loopback
from tests.infra.deploy_files import (
    COMPOSE,
    PASSWORD,
    ROOT,
    as_argv,
    built_services,
    compose_argv,
    compose_mounts,
    compose_services,
    compose_volume_at,
    depends_on,
    duration_s,
    healthcheck_argv,
    interpolate,
    is_app_image,
    k8s_argv,
    redis_image_major,
    redis_listen_port,
    redis_script,
)
from tests.infra.deploy_processes import (
    api_serves,
    app_containers,
    compose_env,
    conveyor_args,
    process_of,
    settings_from,
)


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


def test_celery_workers_have_time_for_the_runs_under_way() -> None:
    """A warm shutdown waits for the task under way (the after-job and batch run: AFTER_JOBS_RUN_S, and its
    webhooks' last wait); killed before, its webhooks are sent again by the next run."""
    from workers.celery_app import AFTER_JOBS_RUN_S

    workers = {n: s for n, s in built_services().items() if process_of(compose_argv(s)) == "celery-worker"}
    assert workers
    for name, service in workers.items():
        settings = settings_from(compose_env(service, {"REDIS_PASSWORD": PASSWORD}))
        grace = duration_s(str(service.get("stop_grace_period", "10s")))
        assert grace > AFTER_JOBS_RUN_S + 3 * settings.webhook_timeout_s, name


def test_compose_gpu_and_cpu_inference() -> None:
    dotenv = {"REDIS_PASSWORD": PASSWORD}
    inference = {n: s for n, s in built_services().items() if process_of(compose_argv(s)) == names.INFERENCE_POOL}
    gpu = [n for n, s in inference.items() if "deploy" in s]
    assert gpu and len(inference) >= 2
    for name, service in inference.items():
        settings = settings_from(compose_env(service, dotenv))
        # its drain, then its output lane's last writes
        assert duration_s(str(service.get("stop_grace_period", "10s"))) > worker_stop_s(settings.drain_grace_s), name
        if name in gpu:
            [device] = service["deploy"]["resources"]["reservations"]["devices"]
            assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
            assert device.get("count", "all") == "all" or int(device["count"]) >= 1
            assert not service.get("profiles"), "the GPU service runs by default"
        else:  # the CPU variant: no GPU to reserve, and a dtype a CPU computes
            assert service.get("profiles"), name
            assert settings.device == "cpu" and settings.dtype in ("auto", "float32", "bfloat16"), name
