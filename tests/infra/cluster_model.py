"""Kubernetes and KEDA as they act on the files: NetworkPolicies evaluated as Kubernetes evaluates them, and the
replicas a ScaledObject asks for."""

from __future__ import annotations

import dataclasses
import ipaddress
import math
from collections.abc import Mapping
from typing import Any

from infra.autoscale import policies_for
from shared import names
from shared.policy import DEFAULT_POLICIES, PoolPolicy
from shared.settings import Settings
from tests.infra.deploy_files import NAMESPACE, of_kind, pod_labels, selects, workloads

HPA_TOLERANCE = 0.1  # kube-controller-manager's --horizontal-pod-autoscaler-tolerance default


# ---- KEDA --------------------------------------------------------------------------------------------


def local_policies(settings: Settings) -> dict[str, PoolPolicy]:
    """What the local autoscaler runs with this configuration, within shared/policy.py's default bounds."""
    bounds = {pool: (p.min_replicas, p.max_replicas) for pool, p in DEFAULT_POLICIES.items()}
    return policies_for(settings, bounds)


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


def isolating(pod: Peer, direction: str, policies: Mapping[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The policies that select this pod for `direction` ("Ingress" or "Egress"); none: all is allowed.
    policies: by name, those in force (default: the manifests')."""
    if pod.namespace != NAMESPACE:
        return []
    return [p for p in (NETWORK_POLICIES if policies is None else policies).values()
            if direction in policy_types(p) and selects(p["spec"]["podSelector"], dict(pod.labels))]


def allows(pod: Peer, direction: str, other: Peer, protocol: str, port: int,
           in_force: Mapping[str, dict[str, Any]] | None = None) -> bool:
    policies = isolating(pod, direction, in_force)
    key, peers = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    return not policies or any(
        (not rule.get(peers) or any(peer_matches(p, other) for p in rule[peers])) and port_matches(rule, protocol, port)
        for policy in policies for rule in policy["spec"].get(key, []))


def reachable(src: Peer, dst: Peer, port: int, protocol: str = "TCP",
              policies: Mapping[str, dict[str, Any]] | None = None) -> bool:
    """Whether src may open a connection to dst's port, under `policies` (default: the manifests')."""
    return (allows(src, "Egress", dst, protocol, port, policies)
            and allows(dst, "Ingress", src, protocol, port, policies))
