"""The Kubernetes manifests parse, validate (strict) and build with kustomize, and each workload runs the process
it is named for, with settings, probes and disruption budgets that work. Redis starts persistent, capped and
locked (as docker compose starts it too), no secret is committed, and every pod is locked down."""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import redis
import yaml
from redis.backoff import NoBackoff
from redis.retry import Retry

from infra.redis_server import redis_binary
from shared import names
from shared.settings import Settings, is_loopback
from tests.infra.deploy_files import (
    CMD,
    COMPONENT,
    CORE_KINDS,
    DOCS,
    ENTRYPOINT,
    K8S,
    KEDA_KINDS,
    KUBERNETES_VERSION,
    KUSTOMIZATION,
    MANIFESTS,
    NAMESPACE,
    PASSWORD,
    ROOT,
    all_containers,
    built_services,
    compose_argv,
    compose_services,
    container,
    instructions,
    is_app_image,
    k8s_argv,
    of_kind,
    pod_labels,
    pod_spec,
    redis_image_major,
    redis_listen_port,
    redis_script,
    selects,
    service_backend,
    workloads,
)
from tests.infra.deploy_processes import (
    RedisStart,
    api_serves,
    app_containers,
    cluster_settings,
    compose_env,
    container_env,
    conveyor_args,
    documented_step,
    internal_paths,
    mount_of,
    process_of,
    read_from_environment,
    redis_start_compose,
    redis_start_k8s,
    run_documented_step,
    settings_from,
)

REDIS_IMAGE_WORKDIR = "/data"  # the official redis image's working directory: redis-server writes there without --dir
NO_RETRY = Retry(NoBackoff(), 0)


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
                path, port = probe["httpGet"]["path"].split("?")[0], probe["httpGet"]["port"]
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
    # each process that reads the model's files (the API its config.json) has it pulled first, into its pod
    pulled = {name for name, c, init in app_containers() if init and k8s_argv(c)[:3] == ["conveyor", "model", "pull"]}
    assert {"api", "tokenizer", names.INFERENCE_POOL} <= pulled, pulled
    api = by_workload["api"]
    assert not is_loopback(api.host), "the API must listen where the Service reaches it"
    ports = {p["containerPort"] for p in container(workloads()["api"])["ports"]}
    assert {api.port, api.internal_port_number} <= ports
    scrape = workloads()["api"]["spec"]["template"]["metadata"]["annotations"]  # where /metrics answers
    assert (scrape["prometheus.io/port"], scrape["prometheus.io/path"]) == (str(api.internal_port_number), "/metrics")
    # /scaling counts occupancy in shares of MAX_NUM_SEQS: the API must count with the engines' number
    assert api.max_num_seqs == by_workload[names.INFERENCE_POOL].max_num_seqs


def test_inference_has_a_gpu_and_time_to_drain() -> None:
    inference = workloads()[names.INFERENCE_POOL]
    gpus = container(inference)["resources"]["limits"]["nvidia.com/gpu"]
    assert isinstance(gpus, int) and gpus >= 1
    from shared.lifecycle import worker_stop_s

    settings = settings_from(container_env(container(inference)))
    drain = settings.drain_grace_s
    # its compute threads are the CPUs its request pays for, not one per core of the node it lands on
    assert settings.torch_threads == math.ceil(float(container(inference)["resources"]["requests"]["cpu"])) >= 1
    # its drain, then its output lane's last writes
    assert inference["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > worker_stop_s(drain)


def test_celery_workers_have_time_for_the_runs_under_way() -> None:
    """A warm shutdown waits for the task under way (the after-job and batch run, and its webhooks' last wait)."""
    from workers.celery_app import AFTER_JOBS_RUN_S

    worker = workloads()["celery-worker"]
    settings = settings_from(container_env(container(worker)))
    grace = worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > AFTER_JOBS_RUN_S + 3 * settings.webhook_timeout_s


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


def answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


@pytest.mark.parametrize("start", [redis_start_k8s, redis_start_compose], ids=["kubernetes", "compose"])
def test_redis_starts_persistent_capped_and_locked(start: Callable[[], RedisStart]) -> None:
    """The files' own start script, run with a real redis-server (on a unix socket instead of its port)."""
    spec = start()
    assert redis_image_major(spec.image) >= 7, "XINFO GROUPS reports `lag` from Redis 7 (6.2: counted entry by entry)"
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
                if "secretKeyRef" in e.get("valueFrom", {}):
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


# ---- kustomize ---------------------------------------------------------------------------------------


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
