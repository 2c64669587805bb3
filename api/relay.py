"""One Redis pub/sub connection per API process (per cluster node that holds subscribed channels),
fanned out to per-stream bounded queues.

Streams subscribe and unsubscribe per job channel on the shared connection. On a Redis Cluster a
job's channel lives in its partition's slot and is sharded (SSUBSCRIBE): there is one connection
per node that owns such slots, never one per stream; when a slot moves or a master fails over, only
the channels of the link that lost them are subscribed again, on the nodes that own their slots now
(the other links read on). A connection is redis-py's own (URL, password,
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
import contextlib
import logging
import math
import random
from collections import deque
from typing import Any

import redis.asyncio as aredis
from redis.crc import key_slot
from redis.exceptions import AskError, ClusterDownError, ResponseError, TryAgainError

from api import sse
from shared import names
from shared.redis_client import CLUSTER_TYPES
from shared.retry import Backoff

log = logging.getLogger("conveyor.relay")

TICK_S = 0.5  # how often silent streams are woken and the connection's health is checked
PING_S = 2.0  # silence on a connection this long: PING it
PONG_S = 2.0  # a PING unanswered this long: the connection is dead (a partition, a paused node), reconnect
CONFIRM_S = 1.0  # how long a new stream waits for Redis to confirm its subscription
CONNECT_S = 2.0  # a link not connected (handshake done) in this long is given up, and opened again
ROUTE_EVERY_S = 0.05  # the router's turns at most this often
ROUTE_BACKOFF_S = 1.0  # the longest wait between two tries to route channels whose node is unreachable
SETTLE_S = 6.0  # after a link is lost or a slot moves, the slot map is read again for this long (a failover settles)
SETTLE_EVERY_S = 1.0  # ... this often
STOP_S = 2.0  # how long stopping waits for the relay's tasks to end
STOP_AGAIN_S = 0.1  # how often it cancels again those that have not


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
        if item is None and self.items and self.items[-1] is None:
            return True  # a re-read is asked already, and none has begun since
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

    def __init__(self, relay: Relay, node: str) -> None:
        self.relay, self.node = relay, node
        self.conn: Any = None  # once connected
        loop = asyncio.get_running_loop()
        self.last_rx = loop.time()
        self.pinged = 0.0
        self.task: asyncio.Task[None] | None = None
        self.connected: asyncio.Future[bool] = loop.create_future()  # True once connected; False if it never was
        self._outbox: list[tuple[Any, ...]] = []
        self._ready = asyncio.Event()
        self.closed = False
        self.lost = False  # given up: its channels went back to the router
        self.wake: set[str] = set()  # jobs whose streams re-read their event streams once this link subscribes them

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
        went away is never opened again here (redis-py would): the relay opens a new link and resubscribes."""
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
            except AskError as exc:  # (and MOVED) a SSUBSCRIBE sent by a slot map that has changed since
                relay._unroute(self, exc.slot_id)  # that slot's channels are routed again
                continue
            except (ClusterDownError, TryAgainError) as exc:
                # a SSUBSCRIBE the cluster refused while it fails over: which one is not said, so every channel
                # of the link is routed again, once the router has read the slot map again
                raise ConnectionError(f"the cluster refused a subscription: {exc}") from exc
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
                relay._unroute(self, key_slot(msg[1]))


class Relay:
    """The API's pub/sub: a link per node that owns subscribed channels, each on its own. A link lost (its node
    failed, paused, cut off, or its slots moved) sends only its own streams back to their event streams: the
    router reads the cluster's slot map again and subscribes them where their slots are now, while the other
    links go on reading."""

    def __init__(self, client: aredis.Redis, queue_size: int = 256) -> None:
        self.client = client
        self.queue_size = queue_size
        self.cluster = isinstance(client, CLUSTER_TYPES)
        self._sub, self._unsub = ("SSUBSCRIBE", "SUNSUBSCRIBE") if self.cluster else ("SUBSCRIBE", "UNSUBSCRIBE")
        self.subs: dict[str, set[Subscription]] = {}
        self.delivered = 0
        self._links: dict[str, Link] = {}  # node ("" for a single Redis) -> its link, connected or connecting
        self._route: dict[str, Link] = {}  # job id -> the link its channel is subscribed on (or will be)
        self._mapped = False  # the slot map was read: channels can be routed (until then they wait in self.subs)
        self._dirty = asyncio.Event()  # channels wait to be routed, or a link was lost: the router's turn
        self._settle_until = 0.0  # until then (a link was lost, a slot moved) the router reads the slot map again
        self._routed_at = 0.0  # the router's last turn
        self._down: set[str] = set()  # nodes whose link was lost since the router's last turn
        self._last_lost: str | None = None  # the node whose link was lost last: asked last for the slot map
        self._pending: dict[bytes, asyncio.Future[None]] = {}  # channel -> its SUBSCRIBE confirmation
        self._connected = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._link_tasks: set[asyncio.Task[None]] = set()  # every link's task and writer until it ends (a link given
        # up leaves `_links` at once, while its task may still be closing its connection)
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
        self._dirty.set()
        self._tasks = [asyncio.create_task(self._router(), name="relay-router"),
                       asyncio.create_task(self._tick(), name="relay-ticker")]
        try:
            async with asyncio.timeout(wait_s):
                await self._connected.wait()
        except TimeoutError:
            log.warning("pub/sub not connected yet; streams fall back to reading event streams")

    async def stop(self) -> None:
        sse.forget_shutdown(self.drain)
        self._stopped.set()
        links, self._links = list(self._links.values()), {}
        self._route.clear()
        for link in links:
            link.close()
        # every task, links given up and opened meanwhile included, cancelled again until it ends: redis-py can turn
        # a cancellation into its own error, and a task that took it for one goes on (a router, reading the slot map
        # from the next node); bounded, as the server's shutdown must not wait on a task that never ends
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STOP_S
        while pending := {t for t in (*self._tasks, *self._link_tasks) if not t.done()}:
            if loop.time() >= deadline:
                log.warning("pub/sub: %d tasks still stopping", len(pending))
                break
            for task in pending:
                task.cancel()
            await asyncio.wait(pending, timeout=STOP_AGAIN_S)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_result(None)
        self._pending.clear()

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
            if self._route_job(job_id) and confirmed is None:
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
            link = self._route.pop(sub.job_id, None)
            channel = names.job_channel(sub.job_id)
            fut = self._pending.pop(channel.encode(), None)
            if fut is not None and not fut.done():
                fut.set_result(None)
            if link is not None and link.conn is not None:
                link.send(self._unsub, channel)

    # --- the links -----------------------------------------------------------------------------
    def _node_of(self, channel: bytes | str) -> str:
        return self.client.get_node_from_key(channel).name if self.cluster else ""  # type: ignore[attr-defined]

    def _route_job(self, job_id: str, wake: bool = False) -> bool:
        """Subscribe the job's channel on its node's link (opened if the node has none). True when a confirmation
        will come: sent now, or when the link connects (it subscribes every channel routed to it). False when the
        channel waits for the router (no slot map yet, no node serves its slot, or its node's link was just lost).
        `wake`: the job's streams re-read their event streams once
        the subscription is sent (the router's: what was published while the channel had no link)."""
        if not self._mapped:
            return False
        channel = names.job_channel(job_id)
        try:
            node = self._node_of(channel)
        except Exception:  # a slot no node serves (a failover under way): the router tries again
            self._dirty.set()
            return False
        link = self._links.get(node)
        if link is None:
            if node in self._down:  # its link was just lost: the router opens the next one, after its backoff
                self._dirty.set()
                return False
            link = self._open(node)
        self._route[job_id] = link
        if link.conn is None:
            if wake:
                link.wake.add(job_id)
        else:
            link.send(self._sub, channel)
            if wake:
                for sub in self.subs.get(job_id, ()):
                    sub.wake()
        return True

    def _open(self, node: str) -> Link:
        link = self._links[node] = Link(self, node)  # no connection yet: it subscribes its channels when it has one
        link.task = self._track(asyncio.create_task(self._link(link), name=f"relay-link-{node}"))
        return link

    def _track(self, task: asyncio.Task[None]) -> asyncio.Task[None]:
        self._link_tasks.add(task)
        task.add_done_callback(self._link_tasks.discard)
        return task

    async def _link(self, link: Link) -> None:
        """Connect to the link's node, subscribe the channels routed to it, read until lost."""
        conn = None
        try:
            if self.cluster:
                target = self.client.get_node(node_name=link.node)  # type: ignore[attr-defined]
                if target is None:
                    raise ConnectionError(f"{link.node} is no longer in the slot map")
                conn = target.connection_class(**target.connection_kwargs)
            else:
                conn = self.client.connection_pool.make_connection()
            async with asyncio.timeout(CONNECT_S):  # a paused node accepts, then never answers the handshake
                await conn.connect()  # redis-py does the URL, AUTH, TLS and the handshake
            if link.closed:
                return
            link.conn = conn
            link.last_rx = asyncio.get_running_loop().time()
            mine = [job_id for job_id, routed in self._route.items() if routed is link]
            # SSUBSCRIBE takes the channels of one slot at a time: group them by partition
            by_slot: dict[int, list[str]] = {}
            for job_id in mine:
                by_slot.setdefault(names.job_partition(job_id) if self.cluster else 0, []).append(job_id)
            for group in by_slot.values():
                for i in range(0, len(group), 512):
                    link.send(self._sub, *[names.job_channel(job_id) for job_id in group[i:i + 512]])
            for job_id in link.wake:  # anything published while it had no link is in the event streams
                for sub in self.subs.get(job_id, ()) if self._route.get(job_id) is link else ():
                    sub.wake()
            link.wake.clear()
            link.connected.set_result(True)
            self._connected.set()
            writer = self._track(asyncio.create_task(link.write(), name=f"relay-write-{link.node}"))
            writer.add_done_callback(lambda t: None if t.cancelled() else self._lose(link, t.exception()))
            try:
                await link.read()
            finally:
                link.close()
                writer.cancel()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # refused, lost, reset, closed by the server, or a protocol error
            self._lose(link, exc)
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):  # already gone
                    await conn.disconnect()

    def _lose(self, link: Link, exc: BaseException | None) -> None:
        """A link is gone (or never came): its channels go back to the router, its streams re-read their event
        streams; the other links are left alone."""
        if not link.connected.done():
            link.connected.set_result(False)
        if link.lost or self._stopped.is_set():
            return
        link.lost = True
        was_connected = link.conn is not None
        if self._links.get(link.node) is link:
            del self._links[link.node]
            self._down.add(link.node)
            self._last_lost = link.node or None
        link.close()
        if link.task is not None and link.task is not asyncio.current_task():
            link.task.cancel()
        orphans = [job_id for job_id, routed in self._route.items() if routed is link]
        self._orphan(orphans)
        self._settle_until = asyncio.get_running_loop().time() + SETTLE_S
        if was_connected:
            log.warning("pub/sub link to %s lost (%s); %d channels to subscribe again", link.node or "redis",
                        exc or "closed", len(orphans))

    def _unroute(self, link: Link, slot: int) -> None:
        """The channels of `slot` on `link` belong elsewhere now (the server said so): route them again."""
        self._orphan([job_id for job_id, routed in self._route.items()
                      if routed is link and key_slot(names.job_channel(job_id).encode()) == slot])
        self._settle_until = asyncio.get_running_loop().time() + SETTLE_S

    def _orphan(self, job_ids: list[str]) -> None:
        for job_id in job_ids:
            del self._route[job_id]
            fut = self._pending.pop(names.job_channel(job_id).encode(), None)
            if fut is not None and not fut.done():
                fut.set_result(None)
            for sub in self.subs.get(job_id, ()):  # now, as what came meanwhile may be there already (a failover
                sub.wake()  # that ended before the link was given up), and again once subscribed on its new link
        self._dirty.set()

    async def _router(self) -> None:
        """Route what waits: read the slot map (again, after a link was lost: a failover, a moved slot), subscribe
        each channel without a link on its node's, and wait for the links opened to connect; backs off while
        they fail (a failed node's slots move once a replica is promoted)."""
        backoff = Backoff(0.1, ROUTE_BACKOFF_S)
        loop = asyncio.get_running_loop()
        last = -math.inf
        while not self._stopped.is_set():
            await self._dirty.wait()
            await asyncio.sleep(max(0.0, last + ROUTE_EVERY_S - loop.time()))  # (a slot map still settling)
            last = self._routed_at = loop.time()
            self._dirty.clear()
            self._down.clear()
            try:
                await self._route_all()
                if backoff.failures:
                    log.info("pub/sub: every channel subscribed again")
                backoff.reset()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self._stopped.is_set():
                    return  # redis-py can turn a cancellation (the relay's stop) into its own error
                if not backoff.failures:
                    log.warning("pub/sub: cannot subscribe every channel yet (%s); retrying with backoff", exc)
                self._dirty.set()
                await asyncio.sleep(backoff.next())

    async def _route_all(self) -> None:
        if self.cluster:
            if self._mapped:  # the slot map as it is now; a silent node asked first would hold the read for the
                # client's socket timeout (10 s), so the one whose link was lost last is asked last
                await self.client.nodes_manager.initialize(  # type: ignore[attr-defined]
                    last_failed_node_name=self._last_lost)
            else:
                await self.client.initialize()
        self._mapped = True
        if self.cluster:
            self._connected.set()
            self._follow_map()
        elif "" not in self._links:
            self._open("")
        unrouted = [job_id for job_id in self.subs if job_id not in self._route]
        if not all([self._route_job(job_id, wake=True) for job_id in unrouted]):
            raise ConnectionError("a channel's slot has no node")
        waiting = [link.connected for link in self._links.values() if not link.connected.done()]
        if waiting:  # (not gather: cancelling the router must not cancel the links' own futures)
            await asyncio.wait(waiting)
            if not all(f.result() for f in waiting):
                raise ConnectionError("a link did not connect")

    def _follow_map(self) -> None:
        """Channels subscribed on a node the slot map no longer gives their slot to leave it for the one it gives.
        Right after a failover a slot map can be read from a node that has not learned of it yet (the old master,
        running again): a channel it routed there is confirmed by that node and given nothing, until a later
        read, while the cluster settles, moves it."""
        moved = [job_id for job_id, link in self._route.items()
                 if self._node_of(names.job_channel(job_id)) != link.node]
        for job_id in moved:
            link = self._route[job_id]
            if link.conn is not None:
                link.send(self._unsub, names.job_channel(job_id))
        self._orphan(moved)

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(TICK_S)
            now = loop.time()
            if now < self._settle_until and now - self._routed_at >= SETTLE_EVERY_S:
                self._dirty.set()  # the router's turn, with nothing waiting: the slot map may have moved on
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
                    log.warning("pub/sub link to %s silent for %.0fs, a PING unanswered; replacing it",
                                link.node or "redis", silent)
                    self._lose(link, ConnectionError(f"silent for {silent:.0f}s"))
                elif silent > PING_S and now - link.pinged > PING_S:
                    link.pinged = now
                    link.send("PING")
