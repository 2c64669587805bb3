"""Worker heartbeats: a key per worker with a TTL a little over the interval, holding its counters."""

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
from shared.redis_client import sync_client
from shared.settings import Settings

log = logging.getLogger(__name__)


def new_worker_id(pool: str) -> str:
    return f"{pool}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Heartbeat(threading.Thread):
    """Writes `hb:{pool}:{worker}` every `interval` seconds with whatever `counters()` returns."""

    def __init__(self, client: redis.Redis, pool: str, worker_id: str, interval: float,
                 counters: Callable[[], dict[str, Any]]) -> None:
        super().__init__(name=f"heartbeat-{pool}", daemon=True)
        self.client, self.key, self.interval = client, names.heartbeat_key(pool, worker_id), interval
        self.counters = counters
        self.stop_event = threading.Event()

    def beat(self) -> None:
        body = {"pid": os.getpid(), "host": socket.gethostname(), "at": time.time(), **self.counters()}
        self.client.set(self.key, json.dumps(body), px=int(self.interval * 2500))

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                self.beat()
            except redis.RedisError as exc:
                log.warning("heartbeat failed: %s", exc)
            self.stop_event.wait(self.interval)

    def stop(self) -> None:
        self.stop_event.set()
        try:
            self.client.delete(self.key)
        except redis.RedisError:
            pass


def live_workers(client: redis.Redis, pool: str) -> list[dict[str, Any]]:
    keys = list(client.scan_iter(match=names.heartbeat_pattern(pool), count=500))
    if not keys:
        return []
    return [json.loads(v) for v in client.mget(keys) if v]


def check_pool(settings: Settings, pool: str) -> bool:
    """For probes: is a worker of this pool alive on this host (this container or pod)?"""
    try:
        workers = live_workers(sync_client(settings.redis_url or "redis://127.0.0.1:6379/0", retries=1), pool)
    except redis.RedisError:
        return False
    host = socket.gethostname()
    mine = [w for w in workers if w.get("host") == host]
    return bool(mine)
