"""The local Redis Cluster spreads keys over its three masters, and survives kill -9 of a master:
a replica takes over and a write acknowledged by WAIT is still there. Needs Debian's redis-server
7.0 (skips without it). The cluster is the test's own."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster

from infra.redis_cluster import LocalCluster, cluster_binary


def test_keys_spread_over_the_masters_and_survive_a_master_killed(tmp_path: Path) -> None:
    try:
        cluster_binary()
    except SystemExit as e:
        pytest.skip(str(e))  # no redis-server 7
    cluster = LocalCluster(tmp_path / "cluster", masters=3, replicas=1)
    try:
        cluster.start(timeout=30)
        keys_spread_and_survive_a_master_killed(cluster)
    finally:
        cluster.stop()


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.05)


def keys_spread_and_survive_a_master_killed(cluster: LocalCluster) -> None:
    assert len(cluster.nodes) == 6 and len(set(cluster.ports)) == 6
    masters = cluster.master_ports()
    assert len(masters) == 3 and len(cluster.replica_ports()) == 3
    for node in cluster.nodes:
        assert stat.S_IMODE(node.config_path.stat().st_mode) == 0o600
        assert cluster.password not in (Path("/proc") / str(node.proc.pid) / "cmdline").read_text()  # type: ignore[union-attr]

    client = RedisCluster.from_url(cluster.url, decode_responses=True)
    try:
        # keys under different hash tags land on every master, and really live there
        holder: dict[str, int] = {}
        for i in range(30):
            key = f"{{tag{i}}}:k"
            client.set(key, f"v{i}")
            holder[key] = client.get_node_from_key(key).port
            with redis.Redis(host="127.0.0.1", port=holder[key], password=cluster.password,
                             decode_responses=True) as direct:
                assert direct.execute_command("CLUSTER", "KEYSLOT", key) == client.keyslot(key)
                assert direct.get(key) == f"v{i}"  # no MOVED: this master owns the slot
        assert set(holder.values()) == set(masters)

        # a write the replica has acknowledged survives kill -9 of its master
        key = "{tag0}:kept"
        victim = holder["{tag0}:k"]
        client.set(key, "kept")
        acked = client.execute_command("WAIT", 1, 1000, target_nodes=client.get_node_from_key(key))
        assert acked == 1
        cluster.kill(victim)
        assert cluster.dead_nodes() == [victim]
        wait_for(lambda: victim not in cluster.master_ports() and len(cluster.master_ports()) == 3, 20,
                 "a replica is promoted in place of the killed master")
        cluster.wait_ok(timeout=20)
        assert client.get(key) == "kept"
        assert [client.get(k) for k in holder] == [f"v{i}" for i in range(30)]  # the others too

        # the killed node comes back as a replica
        cluster.restart_node(victim)
        cluster.wait_ok(timeout=20)
        wait_for(lambda: victim in cluster.replica_ports(), 20, "the restarted node is a replica")
        assert cluster.dead_nodes() == []
    finally:
        client.close()

    procs = [node.proc for node in cluster.nodes]
    cluster.stop()
    for proc in procs:
        assert proc is not None and proc.poll() is not None
        with pytest.raises(ProcessLookupError):
            os.kill(proc.pid, 0)
    groups = {proc.pid for proc in procs if proc is not None}  # each node leads its own session
    assert [pid for pid in _pids() if _pgid(pid) in groups] == []  # no forked child of a node either


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None
