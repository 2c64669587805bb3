"""The Redis that `conveyor up` runs when REDIS_URL is empty: one redis-server (the default), or
with `--redis-cluster N` a local Redis Cluster of N masters and N replicas plus a single-node
redis-server for Celery's broker (kombu has no cluster transport).

Either way the supervisor sees one object: `start()` gives the environment its children need
(REDIS_URL, and CELERY_BROKER_URL for a cluster), `revive()` starts again any process of it that
died (same port, password and data: every client reconnects by itself), `stop()` ends it. Its
processes do not die with the supervisor: infra/redis_guard.py stops them after the rest of the
stack, from the pids in the connection file (`<data>/connection.json`, mode 0600, which also
gives local tools such as `conveyor keys` the URL)."""

from __future__ import annotations

import json
import logging
import os

from infra.redis_cluster import LocalCluster
from infra.redis_server import CONNECTION_FILE, RedisServer, _write_private
from shared.paths import stack_env
from shared.settings import Settings

log = logging.getLogger("conveyor.supervisor")


class EmbeddedRedis:
    def __init__(self, settings: Settings, cluster_masters: int = 0) -> None:
        self.data_dir = settings.redis_data_dir
        self.connection_file = self.data_dir / CONNECTION_FILE
        common = {"maxmemory_mb": settings.redis_maxmemory_mb, "appendfsync": settings.redis_appendfsync,
                  "die_with_parent": False}
        self.cluster: LocalCluster | None = None
        self.servers: list[RedisServer] = []
        if cluster_masters:
            self.cluster = LocalCluster(self.data_dir / "cluster", masters=cluster_masters, replicas=1, **common)
            self.servers.append(RedisServer(self.data_dir / "broker", **common))
        else:
            self.servers.append(RedisServer(self.data_dir, port=int(os.environ.get("REDIS_PORT", "0")), **common))

    @property
    def url(self) -> str:
        return self.cluster.seed_url if self.cluster is not None else self.servers[0].url

    def start(self) -> dict[str, str]:
        env = {}
        for server in self.servers:
            server.start()
        if self.cluster is not None:
            env["CELERY_BROKER_URL"] = self.servers[0].url
            self.cluster.start()
            log.info("Redis Cluster of %d masters and their replicas on 127.0.0.1:%s (data in %s)",
                     self.cluster.masters, ",".join(map(str, self.cluster.ports)), self.data_dir)
        else:
            log.info("redis-server started on 127.0.0.1:%d with a password (data in %s)", self.servers[0].port,
                     self.data_dir)
        env["REDIS_URL"] = self.url
        self.write_connection_file()
        return env

    def pids(self) -> list[int]:
        procs = [s.proc for s in self.servers] + ([n.proc for n in self.cluster.nodes] if self.cluster else [])
        return [p.pid for p in procs if p is not None and p.poll() is None]

    def write_connection_file(self) -> None:
        """{"url", "password", "pid", "pids", "cluster", "env"}: the first pid is the server's (or first node's);
        `env` the stack's partitions and models (shared/paths.py), for `conveyor status` and `keys` in another
        shell."""
        pids = self.pids()
        info = {"url": self.url, "password": self.servers[0].password if self.cluster is None else
                self.cluster.password, "pid": pids[0] if pids else None, "pids": pids,
                "cluster": self.cluster is not None, "env": stack_env()}
        self.data_dir.mkdir(parents=True, exist_ok=True)
        _write_private(self.connection_file, json.dumps(info) + "\n")

    def revive(self) -> None:
        """Start again whatever died (tried again at the next call if it does not come back)."""
        revived = False
        for server in self.servers:
            if server.dead():
                log.warning("redis-server exited (%s); restarting it from its append-only file",
                            server.proc.returncode if server.proc else None)
                try:
                    server.start()
                    revived = True
                except (RuntimeError, OSError) as exc:  # (OSError: its config not written, on a full disk)
                    log.error("redis-server did not come back: %s", exc)
        for port in self.cluster.dead_nodes() if self.cluster is not None else []:
            log.warning("cluster node 127.0.0.1:%d exited; restarting it (it rejoins as a replica)", port)
            try:
                self.cluster.restart_node(port)
                revived = True
            except (RuntimeError, OSError) as exc:
                log.error("cluster node %d did not come back: %s", port, exc)
        if revived:
            try:
                self.write_connection_file()
            except OSError as exc:
                log.error("the connection file could not be written: %s", exc)

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        for server in self.servers:
            server.stop()
        self.connection_file.unlink(missing_ok=True)

