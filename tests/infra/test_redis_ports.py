"""A port chosen free (`free_port`) can be taken by another process before redis-server binds it: many stacks start
side by side in the test suite. A server or a new local cluster then chooses again and starts; a server that
already ran keeps its port, as its clients know it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import redis

import infra.redis_cluster as redis_cluster
from infra.redis_cluster import LocalCluster, cluster_binary
from infra.redis_server import PortTaken, RedisServer


def test_a_server_whose_chosen_port_was_taken_chooses_another(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis", maxmemory_mb=16)
    taken = server.port
    with socket.socket() as thief:
        thief.bind(("127.0.0.1", taken))
        try:
            url = server.start()
            assert server.port != taken and redis.Redis.from_url(url).ping()
        finally:
            server.stop()
        with pytest.raises(PortTaken):  # started once, it keeps its port
            RedisServer(tmp_path / "again", port=taken, maxmemory_mb=16).start(timeout=5)


def test_a_new_cluster_whose_chosen_port_was_taken_chooses_another(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        cluster_binary()
    except SystemExit as e:
        pytest.skip(str(e))  # no redis-server 7
    thieves: list[socket.socket] = []
    choose = redis_cluster.free_port

    def taken_at_once() -> int:  # the first port chosen is taken before its node binds it
        port = choose()
        if not thieves:
            thieves.append(socket.socket())
            thieves[0].bind(("127.0.0.1", port))
        return port

    monkeypatch.setattr(redis_cluster, "free_port", taken_at_once)
    cluster = LocalCluster(tmp_path / "cluster", masters=3, replicas=1)
    try:
        cluster.start(timeout=60)
        assert thieves[0].getsockname()[1] not in cluster.ports
        assert redis.Redis(host="127.0.0.1", port=cluster.ports[0], password=cluster.password).ping()
    finally:
        cluster.stop()
        thieves[0].close()
