"""Worker heartbeats: a key per worker with a TTL a little over the interval, holding its counters,
and the worker's id in its pool's registry (`names.workers_key`, scored by when the heartbeat runs
out), so readers find live workers without a keyspace scan. shared.signals reads both."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis

from shared import names
from shared.lifecycle import name_thread
from shared.redis_client import RETRYABLE, heal, sync_client
from shared.settings import Settings
from shared.signals import read_snapshot

log = logging.getLogger(__name__)


def new_worker_id(pool: str) -> str:
    return f"{pool}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Heartbeat(threading.Thread):
    """Writes `hb:{pool}:{worker}` every `interval` seconds with whatever `counters()` returns, while
    `healthy()` says the worker can do its work (a worker whose writes have failed for too long is not
    called live: its heartbeat runs out, and readiness and the autoscaler see it gone)."""

    def __init__(self, client: redis.Redis, pool: str, worker_id: str, interval: float,
                 counters: Callable[[], dict[str, Any]], healthy: Callable[[], bool] = lambda: True) -> None:
        super().__init__(name=f"heartbeat-{pool}", daemon=True)
        self.client, self.key, self.interval = client, names.heartbeat_key(pool, worker_id), interval
        self.pool, self.worker_id = pool, worker_id
        self.counters, self.healthy = counters, healthy
        self.stop_event = threading.Event()

    def beat(self) -> None:
        body = {"pid": os.getpid(), "host": socket.gethostname(), "at": time.time(), **self.counters()}
        beat(self.client, self.pool, self.worker_id, json.dumps(body), int(self.interval * 2500))

    def run(self) -> None:
        name_thread("heartbeat")
        sick = False
        while not self.stop_event.is_set():
            if not self.healthy():
                if not sick:
                    log.warning("heartbeat withheld: this worker cannot write its work to redis")
                sick = True
            else:
                if sick:
                    log.info("heartbeat resumed")
                sick = False
                try:
                    self.beat()
                except (*RETRYABLE, redis.RedisError) as exc:  # any: a beat missed is never the worker's end
                    log.warning("heartbeat failed: %s", exc)
                    heal(self.client)
            self.stop_event.wait(self.interval)

    def stop(self) -> None:
        self.stop_event.set()
        try:
            forget(self.client, self.pool, self.worker_id)
        except RETRYABLE:
            pass


def beat(client: redis.Redis, pool: str, worker_id: str, body: str, ttl_ms: int) -> None:
    """One heartbeat: the worker's key and its place in the pool's registry (expired ids pruned)."""
    now = time.time()
    pipe = client.pipeline(transaction=False)
    pipe.set(names.heartbeat_key(pool, worker_id), body, px=ttl_ms)
    pipe.zadd(names.workers_key(pool), {worker_id: now + ttl_ms / 1000})
    pipe.zremrangebyscore(names.workers_key(pool), "-inf", now)
    pipe.execute()


def forget(client: redis.Redis, pool: str, worker_id: str) -> None:
    """The worker is gone at once: its key and its place in the registry."""
    pipe = client.pipeline(transaction=False)
    pipe.delete(names.heartbeat_key(pool, worker_id))
    pipe.zrem(names.workers_key(pool), worker_id)
    pipe.execute()


def check_pool(settings: Settings, pool: str) -> bool:
    """For probes (liveness, compose's health): is a worker of this pool alive on this host (this container or
    pod)? Redis out of reach says nothing of it: yes (a restart would meet the same Redis; a Redis outage past the
    probes' patience restarted every worker, dropping its drain and reloading its model)."""
    try:
        client = sync_client(settings.redis_url or "redis://127.0.0.1:6379/0", retries=1)
        workers = read_snapshot(client, (pool,), {}).workers[pool]
    except redis.RedisError:
        return True
    host = socket.gethostname()
    return any(w.host == host for w in workers)
