"""Redis clients with the same reconnect policy everywhere: exponential backoff with jitter. Their
pipelines replay script calls that met a Redis without the scripts (see shared.scripts)."""

from __future__ import annotations

import redis
import redis.asyncio as aredis
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError, TimeoutError
from redis.retry import Retry

from shared import scripts

RETRYABLE = (ConnectionError, TimeoutError, ConnectionResetError, OSError)


class Redis(redis.Redis):
    def pipeline(self, transaction: bool = True, shard_hint: str | None = None) -> scripts.Pipeline:
        return scripts.Pipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)


def sync_client(url: str, decode: bool = True, retries: int = 8) -> redis.Redis:
    return Redis.from_url(
        url, decode_responses=decode, health_check_interval=15, socket_keepalive=True,
        retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=2.0), retries),
        retry_on_error=[ConnectionError, TimeoutError],
    )


def async_client(url: str, max_connections: int = 256) -> aredis.Redis:
    # The API fails fast (one short retry) so a Redis outage becomes a 503, not a hung request.
    # A blocking pool makes a burst of requests wait briefly for a connection instead of failing.
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
