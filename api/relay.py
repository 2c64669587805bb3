"""One Redis pub/sub connection per API process (per cluster node that holds subscribed channels),
fanned out to per-stream bounded queues.

Streams subscribe and unsubscribe per job channel on the shared connection. On a Redis Cluster a
job's channel lives in its partition's slot and is sharded (SSUBSCRIBE): there is one connection
per node that owns such slots, never one per stream; when a slot moves or a master fails over, the
relay reconnects to the nodes that own the slots now. A connection is redis-py's own (URL, password,
TLS, the handshake), used through its public `Connection` API: commands go out through one writer
task per connection (`send_packed_command`, in the order sent), and messages are read one by one
(`read_response`; its hiredis parser keeps every message a socket read holds, so a burst of N
messages costs one read).

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

import redis.asyncio as aredis
from redis.exceptions import ResponseError

from api import sse
from shared import names
from shared.redis_client import CLUSTER_TYPES
from shared.retry import arun_loop

log = logging.getLogger("conveyor.relay")

TICK_S = 0.5  # how often silent streams are woken and the connection's health is checked
PING_S = 2.0  # silence on a connection this long: PING it
PONG_S = 2.0  # a PING unanswered this long: the connection is dead (a partition, a paused node), reconnect
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


class Link:
    """One pub/sub connection (to the Redis, or to one node of a cluster) and what it read last."""

    def __init__(self, relay: Relay, node: str, conn: Any) -> None:
        self.relay, self.node, self.conn = relay, node, conn
        self.last_rx = asyncio.get_running_loop().time()
        self.pinged = 0.0
        self.task: asyncio.Task[None] | None = None
        self._outbox: list[tuple[Any, ...]] = []
        self._ready = asyncio.Event()
        self.closed = False

    def send(self, *args: Any) -> None:
        """Queue a command for the writer (`write`); commands go out in the order sent."""
        self._outbox.append(args)
        self._ready.set()

    def close(self) -> None:
        """End the writer, whether or not its cancellation reaches it (3.11's `asyncio.wait_for`, inside redis-py's
        send, drops a cancel that comes as the send completes: the writer then waited for ever on a link no one
        held, until collected, pending)."""
        self.closed = True
        self._ready.set()

    async def write(self) -> None:
        """Send what is queued, as it comes, everything queued meanwhile in one write. A connection that
        went away is never opened again here (redis-py would): the session reconnects and resubscribes."""
        while True:
            await self._ready.wait()
            if self.closed:
                return
            self._ready.clear()
            commands, self._outbox = self._outbox, []
            if not self.conn.is_connected:
                raise ConnectionError("closed")
            await self.conn.send_packed_command(self.conn.pack_commands(commands), check_health=False)

    async def read(self) -> None:
        conn = self.conn
        loop = asyncio.get_running_loop()
        relay = self.relay
        subs = relay.subs
        while True:
            try:
                msg = await conn.read_response(disable_decoding=True, timeout=math.inf, push_request=True)
            except ResponseError as exc:
                log.warning("pub/sub error reply: %s", exc)
                continue
            self.last_rx = loop.time()
            if not isinstance(msg, list):  # (RESP3 pushes are a list subclass)
                continue  # +PONG outside subscribed mode
            kind = msg[0]
            if kind == b"message" or kind == b"smessage":
                for sub in subs.get(names.channel_job_id(msg[1]), ()):
                    if sub.put(msg[2]):
                        relay.delivered += 1
            elif kind == b"subscribe" or kind == b"ssubscribe":
                fut = relay._pending.pop(msg[1], None)
                if fut is not None and not fut.done():
                    fut.set_result(None)
            elif kind == b"sunsubscribe" and names.channel_job_id(msg[1]) in subs:
                # the server dropped a channel we still want: its slot moved to another node
                raise ConnectionError(f"slot of {msg[1]!r} moved")


class Relay:
    def __init__(self, client: aredis.Redis, queue_size: int = 256) -> None:
        self.client = client
        self.queue_size = queue_size
        self.cluster = isinstance(client, CLUSTER_TYPES)
        self._sub, self._unsub = ("SSUBSCRIBE", "SUNSUBSCRIBE") if self.cluster else ("SUBSCRIBE", "UNSUBSCRIBE")
        self.subs: dict[str, set[Subscription]] = {}
        self.delivered = 0
        self.reconnects = 0
        self._links: dict[str, Link] = {}  # node ("" for a single Redis) -> its connection, while connected
        self._pending: dict[bytes, asyncio.Future[None]] = {}  # channel -> its SUBSCRIBE confirmation
        self._lost: asyncio.Future[None] | None = None  # set when any link is lost: the session ends
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
            if self._send_channel(self._sub, channel) and confirmed is None:
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
            self._send_channel(self._unsub, names.job_channel(sub.job_id).encode())

    # --- the connections ---------------------------------------------------------------------
    def _node_of(self, channel: bytes | str) -> str:
        return self.client.get_node_from_key(channel).name if self.cluster else ""  # type: ignore[attr-defined]

    def _send_channel(self, command: str, channel: bytes) -> bool:
        """Send (UN)SUBSCRIBE on the link of the channel's node. True when a confirmation will come:
        sent now, or the node's link is connecting and subscribes it when connected (on a cluster,
        the first channel of a node opens its link). False when not connected at all (connecting
        subscribes every channel in self.subs)."""
        if self._lost is None:
            return False
        node = self._node_of(channel)
        link = self._links.get(node)
        if link is None:
            if command != self._sub:
                return False
            link = self._open(node)
        if link.conn is not None:
            link.send(command, channel)
        return True

    def _open(self, node: str) -> Link:
        """The node's link, opened if it has none: one a node, whose task is the only one reading it."""
        link = self._links.get(node)
        if link is None:
            link = self._links[node] = Link(self, node, None)  # no connection yet: it subscribes when it has one
            link.task = asyncio.create_task(self._link(node), name=f"relay-link-{node}")
        return link

    async def _link(self, node: str) -> None:
        """Connect to one node, subscribe the channels it owns, read until lost; a lost link ends
        the whole session (the next one routes every channel again, from a fresh slot map)."""
        lost = self._lost
        try:
            if self.cluster:
                target = next(n for n in self.client.get_nodes() if n.name == node)  # type: ignore[attr-defined]
                conn = target.connection_class(**target.connection_kwargs)
            else:
                conn = self.client.connection_pool.make_connection()
            await conn.connect()  # redis-py does the URL, AUTH, TLS and the handshake
            link = self._links.get(node)
            if link is None or link.conn is not None or lost is not self._lost:
                await conn.disconnect()
                return
            link.conn = conn
            link.last_rx = asyncio.get_running_loop().time()
            mine = [job_id for job_id in self.subs if self._node_of(names.job_channel(job_id)) == node]
            # SSUBSCRIBE takes the channels of one slot at a time: group them by partition
            by_slot: dict[int, list[str]] = {}
            for job_id in mine:
                by_slot.setdefault(names.job_partition(job_id) if self.cluster else 0, []).append(job_id)
            for group in by_slot.values():
                for i in range(0, len(group), 512):
                    link.send(self._sub, *[names.job_channel(job_id) for job_id in group[i:i + 512]])
            for job_id in mine:  # anything published while we were away is in the event streams
                for sub in self.subs.get(job_id, ()):
                    sub.wake()
            if not self.cluster:
                self._connected.set()
            writer = asyncio.create_task(link.write(), name=f"relay-write-{node}")
            writer.add_done_callback(lambda t: t.cancelled() or self._lose(lost, t.exception()))
            try:
                await link.read()
            finally:
                link.close()
                writer.cancel()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # lost, reset, closed by the server, moved, or a protocol error
            self._lose(lost, exc)

    @staticmethod
    def _lose(lost: asyncio.Future[None] | None, exc: BaseException | None) -> None:
        """End the session `lost` belongs to (the loop connects again), if it is still on."""
        if lost is not None and not lost.done():
            lost.set_exception(exc or ConnectionError("lost"))

    async def _run(self) -> None:
        await arun_loop(self._session, self._stopped, log, "pub/sub")

    async def _session(self) -> None:
        """Connect and read until a connection is lost; the loop then connects again at once, and
        backs off while connecting fails."""
        try:
            if self.cluster:
                await self.client.initialize()  # type: ignore[attr-defined]
                if self.reconnects:  # the slot map as it is now (after a failover, a moved slot)
                    await self.client.nodes_manager.initialize()  # type: ignore[attr-defined]
            # the session is on from here: until now a new stream's channel waited in self.subs (its node unknown
            # while the slot map was read), and is subscribed below with every other
            self._lost = asyncio.get_running_loop().create_future()
            if self.cluster:
                for node in {self._node_of(names.job_channel(job_id)) for job_id in self.subs}:
                    self._open(node)
                self._connected.set()
            else:
                self._open("")
            channels = len(self.subs)
            if self.reconnects or channels:
                log.info("pub/sub connecting; %d channels to subscribe", channels)
            self.reconnects += 1
            await self._lost
        except Exception as exc:
            if not any(link.conn is not None for link in self._links.values()):
                raise  # connecting failed: the loop backs off
            log.warning("pub/sub connection lost (%s); reconnecting", exc)
        finally:
            await self._drop()

    async def _drop(self) -> None:
        links, self._links = self._links, {}
        self._lost = None
        self._connected.clear()
        for fut in self._pending.values():
            if not fut.done():
                fut.set_result(None)
        self._pending.clear()
        for link in links.values():
            link.close()
            if link.task is not None:
                link.task.cancel()
            if link.conn is not None:
                try:
                    await link.conn.disconnect()
                except Exception:  # already gone
                    pass

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(TICK_S)
            now = loop.time()
            for group in self.subs.values():
                for sub in group:
                    if sub.wake_at <= now:  # spread over the next tick: each wake-up costs its stream a read
                        sub.wake_at = math.inf
                        loop.call_later(random.random() * TICK_S, sub.wake)
            for link in list(self._links.values()):
                if link.conn is None:
                    continue
                silent = now - link.last_rx
                if link.pinged > link.last_rx and now - link.pinged > PONG_S:
                    log.warning("pub/sub connection to %s silent for %.0fs, a PING unanswered; reconnecting",
                                link.node or "redis", silent)
                    self._lose(self._lost, ConnectionError(f"silent for {silent:.0f}s"))
                elif silent > PING_S and now - link.pinged > PING_S:
                    link.pinged = now
                    link.send("PING")
