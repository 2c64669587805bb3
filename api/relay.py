"""One Redis pub/sub connection per API process, fanned out to per-stream bounded queues.

Streams subscribe and unsubscribe per job channel on the shared connection. A subscriber
whose queue is full is marked `overflowed` instead of blocking the reader or growing: its
stream then catches up from the job's event stream.
"""

from __future__ import annotations

import asyncio
import logging
import random

import redis.asyncio as aredis
from redis.exceptions import ConnectionError, TimeoutError

from shared import names

log = logging.getLogger("conveyor.relay")

KEEPALIVE_CHANNEL = f"{names.PREFIX}:relay"


class Subscription:
    def __init__(self, job_id: str, maxsize: int) -> None:
        self.job_id = job_id
        self.queue: asyncio.Queue[str] = asyncio.Queue(maxsize)
        self.overflowed = False

    def reset(self) -> None:
        self.overflowed = False
        while not self.queue.empty():
            self.queue.get_nowait()


class Relay:
    def __init__(self, client: aredis.Redis, queue_size: int = 256) -> None:
        self.client = client
        self.queue_size = queue_size
        self.pubsub = client.pubsub(ignore_subscribe_messages=True)
        self.subs: dict[str, set[Subscription]] = {}
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self.delivered = 0

    async def start(self) -> None:
        await self.pubsub.subscribe(KEEPALIVE_CHANNEL)
        self._task = asyncio.create_task(self._read(), name="relay-reader")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self.pubsub.aclose()

    @property
    def active(self) -> int:
        return sum(len(s) for s in self.subs.values())

    async def subscribe(self, job_id: str) -> Subscription:
        sub = Subscription(job_id, self.queue_size)
        async with self._lock:
            group = self.subs.setdefault(job_id, set())
            group.add(sub)
            if len(group) == 1:
                await self.pubsub.subscribe(names.job_channel(job_id))
        return sub

    async def unsubscribe(self, sub: Subscription) -> None:
        async with self._lock:
            group = self.subs.get(sub.job_id)
            if group is None:
                return
            group.discard(sub)
            if not group:
                del self.subs[sub.job_id]
                try:
                    await self.pubsub.unsubscribe(names.job_channel(sub.job_id))
                except (ConnectionError, TimeoutError):
                    pass  # the channel is gone with the connection anyway

    async def _read(self) -> None:
        prefix_len = len(names.CHANNEL_PREFIX)
        backoff = 0.1
        while True:
            try:
                msg = await self.pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                backoff = 0.1
            except (ConnectionError, TimeoutError, OSError) as exc:
                log.warning("pub/sub connection lost (%s); reconnecting in %.1fs", exc, backoff)
                if self.pubsub.connection is not None:
                    # drop the dead socket now; the next read reconnects and resubscribes every channel
                    await self.pubsub.connection.disconnect()
                await asyncio.sleep(backoff + random.random() * backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            if msg is None or msg.get("type") != "message":
                continue
            channel = msg["channel"]
            for sub in self.subs.get(channel[prefix_len:], ()):
                if sub.overflowed:
                    continue
                try:
                    sub.queue.put_nowait(msg["data"])
                    self.delivered += 1
                except asyncio.QueueFull:
                    sub.overflowed = True
