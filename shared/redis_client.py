"""Redis clients with the same reconnect policy everywhere: exponential backoff with jitter. Their
pipelines replay script calls that met a Redis without the scripts (see shared.scripts).

`REDIS_URL` may name one node of a Redis Cluster, or several, comma-separated (`seeds`): the first
client made for a URL asks its nodes in turn (`INFO cluster`), and from then on every client for it is
a `RedisCluster` that starts from all of them and keeps every node it has discovered (redis-py follows
MOVED/ASK and failovers). A single node stays a plain client, the fast path.

After an outage a cluster client's slot map may still name a node that is gone: a loop that retries
through one calls `heal` (`aheal`), which rebuilds the map from any node the client knows, so that the
retry goes to the promoted replica, never again to the dead node.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any
from urllib.parse import urlsplit

import redis
import redis.asyncio as aredis
import redis.asyncio.cluster as acluster
import redis.cluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialWithJitterBackoff
from redis.connection import parse_url
from redis.exceptions import (
    ClusterError,
    ConnectionError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    RedisClusterUnreachableError,
    ResponseError,
    SlotNotCoveredError,
    TimeoutError,
    TryAgainError,
)
from redis.retry import Retry

from shared import scripts
from shared.redis_errors import WritesRefusedError, refused

# Redis cannot answer now, but will: down or unreachable, a cluster in a failover (no master for a slot
# yet, a write that met a demoted master, a slot in migration), full (at its maxmemory, with noeviction: a
# write refused until TTLs, trimming or an operator free memory), or refusing writes (too few replicas, a failing
# save: a full disk), or a cluster none of whose nodes answers (every one down or cut off); a script's refusal is
# the command's (shared/redis_errors.py)
UNAVAILABLE = (ConnectionError, TimeoutError, ClusterError, TryAgainError, SlotNotCoveredError, ReadOnlyError,
               OutOfMemoryError, WritesRefusedError, RedisClusterUnreachableError)
# and a cluster client that found no node to ask at all (every one it knows is down or cut off)
RETRYABLE = (*UNAVAILABLE, RedisClusterException, ConnectionResetError, OSError)
CLUSTER_TYPES = (redis.cluster.RedisCluster, acluster.RedisCluster)


log = logging.getLogger(__name__)

_KINDS: dict[str, bool] = {}
# a connection whose peer stopped answering (a partition: no reset, no FIN) is found dead within ~10 s,
# not after the kernel's two hours
KEEPALIVE = {socket.TCP_KEEPIDLE: 5, socket.TCP_KEEPINTVL: 2, socket.TCP_KEEPCNT: 3}
CONNECT_TIMEOUT_S = 2.0
# how long a blocking client waits for a reply by default: a node that stops answering (paused, a frozen host: the
# keepalive sees no stopped process) raises TimeoutError, an outage its caller retries, instead of holding it for
# good (a cluster client reading the slot map asks nodes in a random order, a paused replica among them). Every
# blocking read here waits 2 s at most (the after-job drain's XREADGROUP BLOCK), a WAIT 1 s
READ_TIMEOUT_S = 10.0


def seeds(url: str) -> list[str]:
    """The node URLs a `REDIS_URL` lists (comma-separated). An item without a scheme (`host:port`) takes
    the first URL's scheme, credentials and database."""
    items = [u.strip() for u in url.split(",") if u.strip()]
    if not items:
        raise ValueError("REDIS_URL names no node")
    first = urlsplit(items[0])
    out = [items[0]]
    for item in items[1:]:
        if "://" in item:
            out.append(item)
        else:
            auth = first.netloc.rpartition("@")[0]
            out.append(f"{first.scheme}://{auth + '@' if auth else ''}{item}{first.path}")
    return out


def is_cluster(url: str, wait_s: float = 10.0) -> bool:
    """Whether the Redis at `url` (any of its seeds) is a node of a cluster (`cluster_enabled:1`). Asked
    once per URL; while no seed answers (a stack that is starting, a seed node that is down), asked again for up to
    wait_s, and then ConnectionError: a client of the wrong kind would never work (a single node's client, built
    because a cluster's only seed was down as a process started, follows no MOVED once it is back: every call failed
    for good), while a process that exits is started again (the supervisor, Kubernetes) and asks again."""
    if url in _KINDS:
        return _KINDS[url]
    deadline = time.monotonic() + wait_s
    while True:
        for seed in seeds(url):
            probe = redis.Redis.from_url(seed, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=5)
            try:
                kind = _KINDS[url] = int(probe.info("cluster").get("cluster_enabled", 0)) == 1
                if kind and len(seeds(url)) == 1:
                    log.warning("REDIS_URL names one node of a cluster: a process that starts while it is down "
                                "cannot find the others; list several, comma-separated")
                return kind
            except (redis.AuthenticationError, redis.ResponseError) as exc:  # it answers, and refuses us: said
                if not isinstance(exc, redis.AuthenticationError) and "NOAUTH" not in str(exc):
                    raise
                host = urlsplit(seed).netloc.rpartition("@")[2]
                what = "refused the password in" if urlsplit(seed).password else "wants a password, and none is in"
                raise ConnectionError(f"the Redis at {host} {what} REDIS_URL ({exc})") from None
            except (ConnectionError, TimeoutError):
                continue
            finally:
                probe.close()
        if time.monotonic() >= deadline:
            hosts = ", ".join(urlsplit(s).netloc.rpartition("@")[2] for s in seeds(url))
            raise ConnectionError(f"no Redis answers at {hosts} (REDIS_URL): cannot tell a cluster from a single "
                                  f"node; waited {wait_s:.0f} s")
        time.sleep(0.2)


def _cluster_options(url: str) -> dict[str, Any]:
    """A cluster client's startup nodes (every seed) and connection options (the first seed's)."""
    urls = seeds(url)
    options = parse_url(urls[0])
    options.pop("host", None)
    options.pop("port", None)
    options.pop("db", None)  # a cluster has only database 0
    nodes = [(p.get("host", "127.0.0.1"), int(p.get("port", 6379))) for p in map(parse_url, urls)]
    return {"nodes": nodes, **options}


def _sync_cluster(url: str, **kwargs: Any) -> redis.cluster.RedisCluster:
    options = _cluster_options(url)
    nodes = [redis.cluster.ClusterNode(h, p) for h, p in options.pop("nodes")]
    return redis.cluster.RedisCluster(startup_nodes=nodes, **options, **kwargs)


def _async_cluster(url: str, **kwargs: Any) -> acluster.RedisCluster:
    options = _cluster_options(url)
    nodes = [acluster.ClusterNode(h, p) for h, p in options.pop("nodes")]
    return acluster.RedisCluster(startup_nodes=nodes, **options, **kwargs)


def heal(client: Any, failed: str | None = None) -> None:
    """After a failed call: a cluster client rebuilds its slot map from any node it knows (`failed`, the node that
    did not answer, asked last), so the next try reaches whoever holds each slot now. Nothing for a single node,
    whose client reconnects by itself. Never raises: while no node answers, the next try fails again."""
    if not isinstance(client, redis.cluster.RedisCluster):
        return
    try:
        client.nodes_manager.initialize(last_failed_node_name=failed)
    except Exception as exc:  # noqa: BLE001 - the map is rebuilt on the next outage instead
        log.debug("slot map not rebuilt: %s", exc)


async def aheal(client: Any) -> None:
    """`heal` for an asyncio client."""
    if not isinstance(client, acluster.RedisCluster):
        return
    try:
        await client.nodes_manager.initialize()
    except Exception as exc:  # noqa: BLE001
        log.debug("slot map not rebuilt: %s", exc)


async def send_once(client: aredis.Redis | acluster.RedisCluster, key: str,
                    commands: list[tuple[Any, ...]]) -> list[Any]:
    """`commands` in one round trip on one connection (on a cluster, one of the master of `key`), never sent again:
    their replies, an error reply as its exception. For writes that must not run twice (a client's retry after a
    lost reply would), and for a WAIT that must follow its writes on their connection (a cluster pipeline sends a
    failed command again on its own, and a WAIT sent again loses its node). A failed connection raises, and a
    cluster client reads its slot map again first."""
    node: acluster.ClusterNode | None = None
    pool: aredis.ConnectionPool | None = None
    if isinstance(client, acluster.RedisCluster):
        await client.initialize()  # the slot map (once; then a no-op)
        node = client.get_node_from_key(key)
        if node is None:
            raise SlotNotCoveredError(f"no node serves the slot of {key}")
        conn = node.acquire_connection()
    else:
        pool = client.connection_pool
        conn = await pool.get_connection()
    try:
        await conn.send_packed_command(conn.pack_commands(commands))
        got: list[Any] = []
        for _ in commands:
            try:
                got.append(await conn.read_response())
            except ResponseError as exc:
                got.append(refused(exc))
        return got
    except BaseException:
        await conn.disconnect()
        await aheal(client)  # the node may be gone: the next call routes by a fresh slot map
        raise
    finally:
        if node is not None:
            node.release(conn)
        elif pool is not None:
            await pool.release(conn)


class Redis(redis.Redis):
    def pipeline(self, transaction: bool = True, shard_hint: str | None = None) -> scripts.Pipeline:
        return scripts.Pipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)


def sync_client(url: str, decode: bool = True, retries: int = 8, timeout: float = READ_TIMEOUT_S,
                wait_s: float = 10.0) -> redis.Redis:
    """A blocking client. `retries`: how often a failed connection or redirection is tried again; `timeout`: how
    long a reply is waited for; `wait_s`: how long a Redis that does not answer yet is waited for to tell a cluster
    from a single node (`is_cluster`)."""
    retry = Retry(ExponentialWithJitterBackoff(base=0.05, cap=2.0), retries)
    if is_cluster(url, wait_s):
        # a failover takes the cluster a few seconds: redirections and reconnects are retried for that long;
        # the cluster client stands in for a Redis one (the same commands), which its class does not derive from
        return _sync_cluster(  # type: ignore[return-value]
            url, decode_responses=decode, socket_keepalive=True, socket_keepalive_options=KEEPALIVE,
            socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=timeout, retry=retry, health_check_interval=15)
    return Redis.from_url(
        seeds(url)[0], decode_responses=decode, health_check_interval=15, socket_keepalive=True,
        socket_keepalive_options=KEEPALIVE, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=timeout,
        retry=retry, retry_on_error=[ConnectionError, TimeoutError],
    )


def async_client(url: str, max_connections: int = 256) -> aredis.Redis:
    # The API fails fast (one short retry) so a Redis outage becomes a 503, not a hung request. The retry must be
    # asyncio's: redis-py's sync Retry never retries an asyncio call, and then each pooled connection a Redis
    # restart left stale failed its next request.
    # A blocking pool makes a burst of requests wait briefly for a connection instead of failing.
    if is_cluster(url):  # the cluster client stands in for a Redis one, as in sync_client
        return _async_cluster(  # type: ignore[return-value]
            url, decode_responses=True, max_connections=max_connections, socket_connect_timeout=CONNECT_TIMEOUT_S,
            socket_timeout=10, health_check_interval=15, socket_keepalive=True, socket_keepalive_options=KEEPALIVE,
            retry=AsyncRetry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), 3))
    pool = aredis.BlockingConnectionPool.from_url(
        seeds(url)[0], decode_responses=True, max_connections=max_connections, timeout=10, socket_connect_timeout=2,
        socket_timeout=10, health_check_interval=15,
        retry=AsyncRetry(ExponentialWithJitterBackoff(base=0.02, cap=0.2), 1),
        retry_on_error=[ConnectionError, TimeoutError],
    )
    return aredis.Redis(connection_pool=pool)


def text(v: bytes | str | None) -> str:
    """A Redis reply as text, whichever way the client decodes: "" for None (no such key or field)."""
    if v is None:
        return ""
    return v.decode() if isinstance(v, bytes) else str(v)
