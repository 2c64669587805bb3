"""Network partitions on Linux network namespaces, for tests and benchmarks: a namespace per process group
under test, joined to the root namespace by veth pairs on addresses of their own, a link cut and healed at
will, and everything removed on exit, even when the test fails.

    with NetLab() as lab:                       # removes stale namespaces of dead labs first
        ns = lab.namespace("api")               # `ip netns add cvnet-<pid>-<n>-api`, its loopback up
        link = ns.link()                        # a veth pair: link.host_ip (root side), link.ns_ip (inside)
        proc = ns.popen([sys.executable, "-m", "infra.cli", "api"], env=env)   # `ip netns exec ...`
        link.cut()                              # a partition: nothing crosses, in either direction
        link.heal()

Addresses. Each link is a /30 of 10.77.0.0/16 (host side .1, namespace side .2): its index i gives
10.77.(i // 64).(4 * (i % 64)). A link is claimed by creating its root-side device `cvp<i>h`: the kernel
refuses a second device of that name, so concurrent labs (tests beside each other, other runs on the
machine) never share a subnet. The namespace side is created inside the namespace (`peer ... netns`), so
the pair lives and dies with the namespace.

How a cut is made, and why. A real partition drops packets silently: nothing answers, so a connection
that is open hangs (its peer's replies never come; TCP retransmits with backoff) and a new connection
hangs in SYN_SENT until the client's connect timeout; nothing resets. What this does:
- `ip link set <root side> down`. The namespace side loses its carrier: what a process inside sends is
  dropped by the device (no error reaches the socket), and its route to the root side stays (marked
  linkdown), so connects from inside hang rather than fail with "Network is unreachable".
- The neighbour (ARP) entries are permanent on both sides: without them the namespace side's entry is
  flushed with the carrier and a new connect fails at once with EHOSTUNREACH ("No route to host") when
  address resolution fails, which is not what a partition looks like.
- The root side's connected route goes with its device; a route for the /30 at a high metric (`SINK_METRIC`)
  through a sink of the link's own takes over: an ifb device (`cvp<i>b`), which drops what is routed to it
  without a word (it only forwards what tc redirects to it), so the root side's retransmissions and new
  connects to the namespace hang too, rather than leaking out of the default route or failing at once (a
  `blackhole` route answers a connect with EINVAL, `unreachable` with EHOSTUNREACH). Root-side processes
  reach the root-side address itself (a bound Redis, say) through the local table, which keeps it: only
  traffic to and from the namespace is cut.
On heal the device comes up, its routes come back and TCP's retransmissions deliver what was held (after
the backed-off retransmission timer fires: about as long again as the cut lasted, at most).
Why not the alternatives: `tc qdisc ... netem loss 100%` on both ends would be as silent, but needs
sch_netem, which kernels built without it (this one: CONFIG_NET_SCH_NETEM unset) refuse ("Specified qdisc
kind is unknown"); setting the namespace side down (or both) removes its route, so every connect from
inside fails at once with ENETUNREACH and every send with an error: a crash of the network stack, not a
partition. An nftables drop on the output hook is no better: a local sender gets EPERM.

`unavailable()` says why none of this can run here (not root, no `ip`, a kernel that refuses namespaces
or veth pairs), for a test to skip with.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import random
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

PREFIX = "cvnet"  # namespace names: cvnet-<owner pid>-<lab number>-<label>
DEV = "cvp"  # link devices: cvp<index>h (root side), cvp<index>n (namespace side)
SUBNET = ipaddress.ip_network("10.77.0.0/16")
SLOTS = SUBNET.num_addresses // 4  # /30 links
SINK_METRIC = 4242  # the route to the link's /30 through its sink (cvp<i>b), used while the link is cut
_NS_RE = re.compile(rf"^{PREFIX}-(\d+)-")
_DEV_RE = re.compile(rf"^{DEV}\d+[hb]$")
ALIAS = "conveyor netns lab of pid "  # a link's root-side device's alias names the lab's process
_lab_numbers = iter(range(1, 1 << 30))
_lab_lock = threading.Lock()


class NetnsError(RuntimeError):
    pass


def ip(*args: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """`ip ARGS...`; NetnsError with its stderr when it fails (and `check`)."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done


@functools.cache
def unavailable() -> str | None:
    """Why namespaces with veth pairs cannot be made here (a reason to skip), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "no `ip` command (apt-get install iproute2)"
    name = f"{PREFIX}-{os.getpid()}-0-probe{random.randrange(1 << 20)}"
    try:
        done = ip("netns", "add", name, check=False)
        if done.returncode != 0:
            return f"the kernel refuses `ip netns add`: {done.stderr.strip()}"
        done = ip("-n", name, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1", check=False)
        if done.returncode != 0:
            return f"the kernel refuses a veth pair: {done.stderr.strip()}"
        done = ip("-n", name, "link", "set", "lo", "up", check=False)
        if done.returncode != 0:
            return f"cannot bring a namespace's loopback up: {done.stderr.strip()}"
        done = ip("-n", name, "link", "add", "probe2", "type", "ifb", check=False)
        if done.returncode != 0:
            return f"the kernel refuses an ifb device (a cut link's sink): {done.stderr.strip()}"
    except (OSError, subprocess.SubprocessError) as e:
        return f"`ip` failed: {e}"
    finally:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            ip("netns", "del", name, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespace_pids(name: str) -> list[int]:
    """The processes inside namespace `name` (`ip netns pids`)."""
    done = ip("netns", "pids", name, check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def _stop_pids(pids: Sequence[int], grace: float = 5.0) -> None:
    """SIGTERM these processes (ours: they run in a namespace of ours), SIGKILL those still there after `grace`."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    left = list(pids)
    while left and time.monotonic() < deadline:
        left = [p for p in left if _alive(p) and not _zombie(p)]
        time.sleep(0.05)
    for pid in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def link_subnet(index: int) -> ipaddress.IPv4Network:
    """The /30 of link `index`."""
    return ipaddress.ip_network(f"{SUBNET.network_address + 4 * index}/30")


def cleanup_stale() -> list[str]:
    """Remove what labs of processes now dead left behind: their namespaces (and the processes still in them,
    which such a lab started), whose removal takes their veth pairs along, and their links' sinks.
    Returns what it removed."""
    removed = []
    listed = ip("netns", "list", check=False).stdout.split("\n")
    for line in listed:
        name = line.split(" ")[0].strip()
        m = _NS_RE.match(name)
        if m and not _alive(int(m[1])):
            _stop_pids(namespace_pids(name), grace=2)
            ip("netns", "del", name, check=False)
            removed.append(name)
    # the links of dead labs: their root-side devices (a namespace's deletion takes its pairs along, but in the
    # kernel's own time) and their sinks, each route through one going with it
    for dev in os.listdir("/sys/class/net") if os.path.isdir("/sys/class/net") else []:
        if _DEV_RE.match(dev) and not _alive(_owner(dev) or os.getpid()):
            ip("link", "del", dev, check=False)
            removed.append(dev)
    return removed


@dataclass
class Link:
    """A veth pair from the root namespace into namespace `ns`: `host_ip` on `host_dev` (root side), `ns_ip`
    on `ns_dev` (inside), a /30 of their own."""

    ns: str
    index: int
    host_dev: str
    ns_dev: str
    host_ip: str
    ns_ip: str
    host_mac: str = ""
    ns_mac: str = ""
    is_cut: bool = False
    history: list[tuple[str, float]] = field(default_factory=list)  # ("cut" | "heal", time.time())

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        return link_subnet(self.index)

    def cut(self) -> None:
        """Partition: nothing crosses the link, in either direction, and nothing says so (see the module's
        docstring for how and why)."""
        ip("link", "set", self.host_dev, "down")
        self.is_cut = True
        self.history.append(("cut", time.time()))

    @property
    def sink_dev(self) -> str:
        return f"{DEV}{self.index}b"

    def heal(self) -> None:
        """Join the link again; TCP's retransmissions then deliver what the cut held."""
        self.history.append(("heal", time.time()))  # (before: what crosses from now on is after the heal)
        ip("link", "set", self.host_dev, "up")
        # the root side's neighbour entries went with its device: the permanent one again, so the link never
        # depends on address resolution (the namespace side kept its own)
        ip("neigh", "replace", self.ns_ip, "lladdr", self.ns_mac, "dev", self.host_dev, "nud", "permanent")
        self.is_cut = False

    @contextlib.contextmanager
    def partitioned(self) -> Iterator[Link]:
        """Cut for the block's duration; healed on the way out, whatever happened in it."""
        self.cut()
        try:
            yield self
        finally:
            if self.is_cut:
                self.heal()


class Namespace:
    """A network namespace of a lab: a loopback of its own and the links `link()` makes to the root namespace."""

    def __init__(self, lab: NetLab, name: str, label: str) -> None:
        self.lab, self.name, self.label = lab, name, label
        self.links: list[Link] = []

    def link(self) -> Link:
        """A new veth pair between the root namespace and this one, on a /30 nobody else holds."""
        taken = _addresses_in_use()
        for _ in range(64):
            index = random.randrange(1, SLOTS)
            net = link_subnet(index)
            if any(a in net for a in taken):
                continue
            host_dev, ns_dev = f"{DEV}{index}h", f"{DEV}{index}n"
            # the claim: creating the root-side device fails if another lab holds this index
            done = ip("link", "add", host_dev, "type", "veth", "peer", "name", ns_dev, "netns", self.name,
                      check=False)
            if done.returncode != 0:
                if "exists" in done.stderr:
                    continue
                raise NetnsError(f"ip link add {host_dev}: {done.stderr.strip()}")
            hosts = list(net.hosts())
            link = Link(self.name, index, host_dev, ns_dev, str(hosts[0]), str(hosts[1]))
            self.links.append(link)
            self.lab._links.append(link)
            ip("link", "set", host_dev, "alias", f"{ALIAS}{os.getpid()}")
            ip("addr", "add", f"{link.host_ip}/30", "dev", host_dev)
            ip("-n", self.name, "addr", "add", f"{link.ns_ip}/30", "dev", ns_dev)
            ip("link", "set", host_dev, "up")
            ip("-n", self.name, "link", "set", ns_dev, "up")
            link.host_mac = _read(f"/sys/class/net/{host_dev}/address")
            link.ns_mac = self.run(["cat", f"/sys/class/net/{ns_dev}/address"]).stdout.strip()
            ip("neigh", "replace", link.ns_ip, "lladdr", link.ns_mac, "dev", host_dev, "nud", "permanent")
            ip("-n", self.name, "neigh", "replace", link.host_ip, "lladdr", link.host_mac, "dev", ns_dev,
               "nud", "permanent")
            ip("link", "add", link.sink_dev, "type", "ifb")
            ip("link", "set", link.sink_dev, "alias", f"{ALIAS}{os.getpid()}")
            ip("link", "set", link.sink_dev, "up")
            ip("route", "replace", str(net), "dev", link.sink_dev, "metric", str(SINK_METRIC))
            return link
        raise NetnsError("no free /30 in 10.77.0.0/16 after 64 tries")

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def popen(self, argv: Sequence[str], env: dict[str, str] | None = None, **kwargs: Any) -> subprocess.Popen[Any]:
        """Start `argv` inside this namespace, with `env` (`ip netns exec` execs the command in place: the
        Popen's pid is the command's own, and a preexec_fn's PR_SET_PDEATHSIG holds for it)."""
        return subprocess.Popen(self.command(argv), env=env, **kwargs)

    def run(self, argv: Sequence[str], env: dict[str, str] | None = None, timeout: float = 60.0,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(self.command(argv), env=env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise NetnsError(f"in {self.name}: {' '.join(argv)}: {done.stderr.strip() or done.returncode}")
        return done

    def pids(self) -> list[int]:
        return namespace_pids(self.name)


class NetLab:
    """The namespaces and links of one test (or benchmark run): a context manager that removes them all on exit,
    and, on entry, what labs of dead processes left behind."""

    def __init__(self) -> None:
        with _lab_lock:
            self.number = next(_lab_numbers)
        self.namespaces: list[Namespace] = []
        self._links: list[Link] = []
        self.closed = False

    def __enter__(self) -> NetLab:
        reason = unavailable()
        if reason:
            raise NetnsError(reason)
        cleanup_stale()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def namespace(self, label: str) -> Namespace:
        label = re.sub(r"[^A-Za-z0-9_.]", "_", label)[:24]
        name = f"{PREFIX}-{os.getpid()}-{self.number}-{label}"
        if any(ns.name == name for ns in self.namespaces):  # the same label again: numbered
            name += f".{len(self.namespaces)}"
        ip("netns", "add", name)
        ns = Namespace(self, name, label)
        self.namespaces.append(ns)
        ip("-n", name, "link", "set", "lo", "up")
        return ns

    def close(self) -> None:
        """Stop what still runs in the lab's namespaces, delete them (their links go with them) and the links'
        sinks. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        for ns in self.namespaces:
            _stop_pids(ns.pids())
        for ns in self.namespaces:
            ip("netns", "del", ns.name, check=False)
        for link in self._links:
            ip("link", "del", link.host_dev, check=False)  # gone with its namespace already, normally
            ip("link", "del", link.sink_dev, check=False)  # and its route with it


def _addresses_in_use() -> list[ipaddress.IPv4Address]:
    out = []
    for line in ip("-4", "-o", "addr", "show", check=False).stdout.splitlines():
        m = re.search(r"inet (\d+\.\d+\.\d+\.\d+)/", line)
        if m:
            out.append(ipaddress.ip_address(m[1]))
    return out  # type: ignore[return-value]


def _owner(dev: str) -> int | None:
    """The pid of the lab that made the root-side device `dev` (its alias), None when it names none."""
    try:
        alias = _read(f"/sys/class/net/{dev}/ifalias")
    except OSError:
        return None
    return int(alias[len(ALIAS):]) if alias.startswith(ALIAS) and alias[len(ALIAS):].isdigit() else None


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()
