"""One Redis pub/sub connection per API process, fanned out to per-stream bounded queues.

Streams subscribe and unsubscribe per job channel on the shared connection. The connection is
opened by redis-py (URL, password, TLS) and then read here directly: each socket read is parsed
by hiredis into all the messages it holds, so a burst of N messages costs one read, not N
round trips through a general-purpose client.

A subscriber's queue carries message bytes, or None for "re-read the job's event stream": sent
after a reconnect (messages published meanwhile are lost to pub/sub, never to the event stream)
and after `wake_at` passes with nothing delivered (one timer here for every stream, not one per
stream per event). A subscriber whose queue is full is marked `overflowed` instead of blocking the
reader or growing; it too re-reads the event stream.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections import deque
from typing import Any

import hiredis
import redis.asyncio as aredis

from api import sse
from shared import names
from shared.retry import arun_loop

log = logging.getLogger("conveyor.relay")

TICK_S = 0.5  # how often silent streams are woken and the connection's health is checked
PING_S = 5.0  # silence on the connection this long: PING; three times this: reconnect
CONFIRM_S = 1.0  # how long a new stream waits for Redis to confirm its subscription


class Subscription:
    """A bounded queue of one stream's messages: a deque and one waiter (what asyncio.Queue does,
    without its bookkeeping; there is one reader and one consumer)."""

    def __init__(self, job_id: str, maxsize: int) -> None:
        self.job_id = job_id
        self.maxsize = maxsize
        self.items: deque[bytes | None] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.wake_at = math.inf  # loop time at which an idle stream gets a None
        self.overflowed = False  # messages were dropped: the stream must re-read the event stream

    def put(self, item: bytes | None) -> bool:
        """Queue an item; False (and `overflowed` set) if the queue is full or already overflowed."""
        if self.overflowed or len(self.items) >= self.maxsize:
            self.overflowed = True
            return False
        self.items.append(item)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        return True

    async def get(self) -> bytes | None:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.items.popleft()

    def reset(self) -> None:
        self.overflowed = False
        self.items.clear()

    def wake(self) -> None:
        """Ask the stream to re-read the event stream (a full queue has its turn coming anyway)."""
        self.wake_at = math.inf
        self.put(None)


class Relay:
    def __init__(self, client: aredis.Redis, queue_size: int = 256) -> None:
        self.client = client
        self.queue_size = queue_size
        self.subs: dict[str, set[Subscription]] = {}
        self.delivered = 0
        self.reconnects = 0
        self._conn: Any = None  # connected: a redis-py connection whose socket this class reads
        self._pending: dict[bytes, asyncio.Future[None]] = {}  # channel -> its SUBSCRIBE confirmation
        self._last_rx = 0.0
        self._connected = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = asyncio.Event()
        self.stopping = False  # the server is shutting down: streams end (clients resume elsewhere)

    def drain(self) -> None:
        """Server shutdown: wake every stream so each ends now, cleanly, instead of being cut off."""
        self.stopping = True
        for group in self.subs.values():
            for sub in group:
                sub.wake()

    async def start(self, wait_s: float = 5.0) -> None:
        """Start reading; wait (up to wait_s) for the first connection."""
        sse.on_shutdown(self.drain)
        self._tasks = [asyncio.create_task(self._run(), name="relay-reader"),
                       asyncio.create_task(self._tick(), name="relay-ticker")]
        try:
            async with asyncio.timeout(wait_s):
                await self._connected.wait()
        except TimeoutError:
            log.warning("pub/sub not connected yet; streams fall back to reading event streams")

    async def stop(self) -> None:
        sse.forget_shutdown(self.drain)
        self._stopped.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._drop()

    @property
    def active(self) -> int:
        return sum(len(s) for s in self.subs.values())

    async def subscribe(self, job_id: str) -> Subscription:
        """A queue for the job's messages; returns once Redis has confirmed the subscription
        (or after CONFIRM_S: a stream re-reads its event stream on any gap, so it loses nothing)."""
        sub = Subscription(job_id, self.queue_size)
        group = self.subs.setdefault(job_id, set())
        group.add(sub)
        channel = names.job_channel(job_id).encode()
        confirmed = self._pending.get(channel)
        if len(group) == 1:
            self._send("SUBSCRIBE", channel)  # if not connected, connecting subscribes it
            if confirmed is None:
                confirmed = self._pending[channel] = asyncio.get_running_loop().create_future()
        if confirmed is not None:
            try:
                async with asyncio.timeout(CONFIRM_S):
                    await asyncio.shield(confirmed)
            except TimeoutError:
                pass
            except BaseException:  # cancelled (the client left while we waited): leave nothing behind
                self._remove(sub)
                raise
        return sub

    async def unsubscribe(self, sub: Subscription) -> None:
        self._remove(sub)

    def _remove(self, sub: Subscription) -> None:
        group = self.subs.get(sub.job_id)
        if group is None:
            return
        group.discard(sub)
        if not group:
            del self.subs[sub.job_id]
            self._send("UNSUBSCRIBE", names.job_channel(sub.job_id))

    # --- the connection ----------------------------------------------------------------------
    def _send(self, *args: Any) -> bool:
        conn = self._conn
        if conn is None:
            return False  # (re)connecting subscribes every channel in self.subs
        conn._writer.write(b"".join(conn.pack_command(*args)))
        return True

    async def _run(self) -> None:
        await arun_loop(self._session, self._stopped, log, "pub/sub")

    async def _session(self) -> None:
        """Connect and read until the connection is lost; the loop then connects again at once, and
        backs off while connecting fails."""
        try:
            await self._connect()
        except Exception:
            await self._drop()
            raise
        try:
            await self._read()
        except Exception as exc:  # lost, reset, closed by the server, or a protocol error
            log.warning("pub/sub connection lost (%s); reconnecting", exc)
        await self._drop()

    async def _connect(self) -> None:
        conn = self.client.connection_pool.make_connection()
        await conn.connect()  # redis-py does the URL, AUTH, TLS and the handshake
        self._conn = conn
        self._connected.set()
        self._last_rx = asyncio.get_running_loop().time()
        channels = [names.job_channel(job_id) for job_id in self.subs]
        for i in range(0, len(channels), 512):
            self._send("SUBSCRIBE", *channels[i:i + 512])
        if self.reconnects or channels:
            log.info("pub/sub connected; %d channels subscribed", len(channels))
        self.reconnects += 1
        for group in self.subs.values():  # anything published while we were away is in the event streams
            for sub in group:
                sub.wake()

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        self._connected.clear()
        for fut in self._pending.values():
            if not fut.done():
                fut.set_result(None)
        self._pending.clear()
        if conn is not None:
            try:
                await conn.disconnect()
            except Exception:  # already gone
                pass

    async def _read(self) -> None:
        parser = hiredis.Reader()
        stream = self._conn._reader
        loop = asyncio.get_running_loop()
        prefix = len(names.CHANNEL_PREFIX)
        subs = self.subs
        while True:
            data = await stream.read(1 << 16)
            if not data:
                raise ConnectionError("closed by the server")
            self._last_rx = loop.time()
            parser.feed(data)
            while (msg := parser.gets()) is not False:
                if not isinstance(msg, list):  # (RESP3 pushes are a list subclass)
                    if isinstance(msg, hiredis.ReplyError):
                        log.warning("pub/sub error reply: %s", msg)
                    continue  # +PONG outside subscribed mode
                kind = msg[0]
                if kind == b"message":
                    for sub in subs.get(msg[1][prefix:].decode(), ()):
                        if sub.put(msg[2]):
                            self.delivered += 1
                elif kind == b"subscribe":
                    fut = self._pending.pop(msg[1], None)
                    if fut is not None and not fut.done():
                        fut.set_result(None)

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        pinged = 0.0
        while True:
            await asyncio.sleep(TICK_S)
            now = loop.time()
            for group in self.subs.values():
                for sub in group:
                    if sub.wake_at <= now:  # spread over the next tick: each wake-up costs its stream a read
                        sub.wake_at = math.inf
                        loop.call_later(random.random() * TICK_S, sub.wake)
            if self._conn is not None:
                silent = now - self._last_rx
                if silent > 3 * PING_S:
                    log.warning("pub/sub connection silent for %.0fs; reconnecting", silent)
                    self._conn._writer.transport.abort()  # the reader sees it and reconnects
                elif silent > PING_S and now - pinged > PING_S:
                    pinged = now
                    self._send("PING")
