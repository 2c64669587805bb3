"""Redis clients with the same reconnect policy everywhere: exponential backoff with jitter. Their
pipelines replay script calls that met a Redis without the scripts (see shared.scripts).

`REDIS_URL` may name one node of a Redis Cluster: the first client made for a URL asks that node
(`INFO cluster`), and from then on every client for it is a `RedisCluster` (redis-py follows
MOVED/ASK and failovers). A single node stays a plain client, the fast path.
"""

from __future__ import annotations

import time

import redis
import redis.asyncio as aredis
import redis.asyncio.cluster as acluster
import redis.cluster
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import (
    ClusterError,
    ConnectionError,
    ReadOnlyError,
    SlotNotCoveredError,
    TimeoutError,
    TryAgainError,
)
from redis.retry import Retry

from shared import scripts

# Redis cannot answer now, but will: down or unreachable, or a cluster in a failover (no master for
# a slot yet, a write that met a demoted master, a slot in migration)
UNAVAILABLE = (ConnectionError, TimeoutError, ClusterError, TryAgainError, SlotNotCoveredError, ReadOnlyError)
RETRYABLE = (*UNAVAILABLE, ConnectionResetError, OSError)
CLUSTER_TYPES = (redis.cluster.RedisCluster, acluster.RedisCluster)


_KINDS: dict[str, bool] = {}


def is_cluster(url: str, wait_s: float = 10.0) -> bool:
    """Whether the Redis at `url` is a node of a cluster (`cluster_enabled:1`). Asked once per URL;
    while Redis does not answer (a stack that is starting), asked again for up to wait_s, and then
    taken for a single node until it answers."""
    if url in _KINDS:
        return _KINDS[url]
    deadline = time.monotonic() + wait_s
    while True:
        probe = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=5)
        try:
            kind = _KINDS[url] = int(probe.info("cluster").get("cluster_enabled", 0)) == 1
            return kind
        except (ConnectionError, TimeoutError):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)
        finally:
            probe.close()


class Redis(redis.Redis):
    def pipeline(self, transaction: bool = True, shard_hint: str | None = None) -> scripts.Pipeline:
        return scripts.Pipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)


def sync_client(url: str, decode: bool = True, retries: int = 8) -> redis.Redis:
    retry = Retry(ExponentialWithJitterBackoff(base=0.05, cap=2.0), retries)
    if is_cluster(url):
        # a failover takes the cluster a few seconds: redirections and reconnects are retried for that long
        return redis.cluster.RedisCluster.from_url(  # type: ignore[return-value]
            url, decode_responses=decode, socket_keepalive=True, retry=retry, health_check_interval=15)
    return Redis.from_url(
        url, decode_responses=decode, health_check_interval=15, socket_keepalive=True,
        retry=retry, retry_on_error=[ConnectionError, TimeoutError],
    )


def async_client(url: str, max_connections: int = 256) -> aredis.Redis:
    # The API fails fast (one short retry) so a Redis outage becomes a 503, not a hung request.
    # A blocking pool makes a burst of requests wait briefly for a connection instead of failing.
    if is_cluster(url):
        return acluster.RedisCluster.from_url(  # type: ignore[return-value]
            url, decode_responses=True, max_connections=max_connections, socket_connect_timeout=2,
            socket_timeout=10, health_check_interval=15,
            retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), 3))
    pool = aredis.BlockingConnectionPool.from_url(
        url, decode_responses=True, max_connections=max_connections, timeout=10, socket_connect_timeout=2,
        socket_timeout=10, health_check_interval=15,
        retry=Retry(ExponentialWithJitterBackoff(base=0.02, cap=0.2), 1),
        retry_on_error=[ConnectionError, TimeoutError],
    )
    return aredis.Redis(connection_pool=pool)


def text(v: bytes | str | None) -> str:
    """A Redis reply as text, whichever way the client decodes: "" for None (no such key or field)."""
    if v is None:
        return ""
    return v.decode() if isinstance(v, bytes) else str(v)
