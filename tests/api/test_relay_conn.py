"""The relay's own pub/sub connection against a real redis-server: subscriptions confirmed before
a stream reads its backlog, fan-out to every stream of a job, overflow marking, a Redis restart
and a connection gone silent (its packets dropped), each of which wakes the streams of the lost link to
re-read the event streams and resubscribes its channels; on a cluster, the other nodes' links read on."""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import socketserver
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis
from redis.crc import key_slot

from api.relay import PING_S, PONG_S, Relay
from infra.redis_cluster import LocalCluster, cluster_binary
from infra.redis_server import RedisServer
from shared import names
from shared.redis_client import async_client

MakeRelay = Callable[..., Awaitable[Relay]]


@pytest.fixture
async def make_relay() -> AsyncIterator[MakeRelay]:
    """`await make_relay(url, queue_size=256, wait_s=5.0)`: a started relay, stopped after the test, leaving no task
    behind."""
    made: list[tuple[Relay, object]] = []

    async def make(url: str, queue_size: int = 256, wait_s: float = 5.0) -> Relay:
        client = async_client(url)
        relay = Relay(client, queue_size)
        made.append((relay, client))
        await relay.start(wait_s)
        return relay

    yield make
    for relay, client in made:
        await relay.stop()
        await client.aclose()  # type: ignore[attr-defined]
    # none of its tasks goes on (a router whose cancel redis-py turned into its own error went on for ever)
    assert not [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("relay-")]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    """A local Redis Cluster of 3 masters, no replicas (set up before the relay, so stopped after it)."""
    try:
        cluster_binary()
    except SystemExit as e:
        pytest.skip(str(e))  # no redis-server 7
    made = LocalCluster(tmp_path / "cluster", masters=3, replicas=0, appendfsync="no")
    made.start()
    yield made
    made.stop()


async def _next(sub, timeout: float = 5.0):  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout):
        return await sub.get()


async def test_confirmed_subscription_gets_the_very_next_publish(redis_url: str, make_relay: MakeRelay) -> None:
    relay = await make_relay(redis_url, queue_size=8)
    pub = redis.Redis.from_url(redis_url)
    for i in range(20):  # a publish right after subscribe() returns is never missed
        sub = await relay.subscribe(f"job_confirm_{i}")
        assert pub.publish(names.job_channel(f"job_confirm_{i}"), b'{"seq": 1}') == 1
        assert await _next(sub) == b'{"seq": 1}'
        await relay.unsubscribe(sub)
    twins = [await relay.subscribe("job_twin") for _ in range(3)]
    pub.publish(names.job_channel("job_twin"), b"x")
    assert [await _next(s) for s in twins] == [b"x"] * 3
    assert relay.active == 3
    for s in twins:
        await relay.unsubscribe(s)
    assert relay.active == 0 and not relay.subs


async def test_full_queue_marks_overflow_without_blocking_others(redis_url: str, make_relay: MakeRelay) -> None:
    relay = await make_relay(redis_url, queue_size=4)
    pub = redis.Redis.from_url(redis_url)
    stalled = await relay.subscribe("job_stalled")
    live = await relay.subscribe("job_live")
    for i in range(10):
        pub.publish(names.job_channel("job_stalled"), b"s%d" % i)
    pub.publish(names.job_channel("job_live"), b"hello")
    assert await _next(live) == b"hello"
    assert stalled.overflowed and len(stalled.items) == 4
    stalled.reset()
    assert not stalled.overflowed and not stalled.items


async def test_idle_stream_is_woken_at_its_deadline(redis_url: str, make_relay: MakeRelay) -> None:
    relay = await make_relay(redis_url)
    sub = await relay.subscribe("job_quiet")
    sub.wake_at = asyncio.get_running_loop().time() + 0.3
    t0 = time.monotonic()
    assert await _next(sub, 3.0) is None
    assert 0.25 < time.monotonic() - t0 < 1.5


@pytest.mark.parametrize("which", ["router", "link given up"])
async def test_stopping_ends_a_task_whose_first_cancellation_was_swallowed(redis_url: str, make_relay: MakeRelay,
                                                                           which: str) -> None:
    """redis-py can take a cancellation for its own error (a timeout met as the cancel came), and the task goes on:
    stopping cancels what has not ended again until it does, the task of a link already given up (no longer among
    the relay's links, still closing its connection) too. A link and its writer left behind held the test's
    teardown, 2 fresh-clone runs in ~10 of a loaded suite. Here the router, or a given-up link's task, swallows its
    first cancellation."""
    relay = await make_relay(redis_url)
    swallowed = asyncio.Event()

    async def stubborn() -> None:
        try:
            await asyncio.sleep(math.inf)
        except asyncio.CancelledError:
            swallowed.set()  # as redis-py's error would be: taken, and the task goes on
        await asyncio.sleep(math.inf)

    if which == "router":
        router = next(t for t in relay._tasks if t.get_name() == "relay-router")
        router.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await router
        relay._tasks[relay._tasks.index(router)] = asyncio.create_task(stubborn(), name="relay-router")
    else:
        relay._track(asyncio.create_task(stubborn(), name="relay-link-given-up"))
    await asyncio.sleep(0)
    await relay.stop()
    assert swallowed.is_set()
    assert not [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("relay-")]


async def test_redis_restart_wakes_streams_and_resubscribes(tmp_path: Path, make_relay: MakeRelay) -> None:
    server = RedisServer(tmp_path / "redis", appendonly=False)
    server.start()
    try:
        relay = await make_relay(server.url)
        subs = [await relay.subscribe(f"job_restart_{i}") for i in range(3)]
        server.stop()
        await asyncio.sleep(0.5)
        server.start()  # same port
        for sub in subs:  # told to re-read the event stream: what was published meanwhile is there
            assert await _next(sub, 15.0) is None
        pub = redis.Redis.from_url(server.url)
        deadline = time.monotonic() + 10
        while pub.publish(names.job_channel("job_restart_0"), b"after") == 0:  # until resubscribed
            assert time.monotonic() < deadline, "the relay did not resubscribe after the restart"
            await asyncio.sleep(0.05)
        got = await _next(subs[0])
        while got is None:  # (asked again once subscribed)
            got = await _next(subs[0])
        assert got == b"after"
        pub.close()
    finally:
        server.stop()


class Muting:
    """A TCP forwarder to a Redis whose connections open so far can be muted: what either side sends on them is
    dropped from then on, as a network path that went dead (no reset, no FIN); new connections pass."""

    def __init__(self, url: str) -> None:
        """`url`: the Redis's; `self.url` is the same through this forwarder."""
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        self.muted: set[socket.socket] = set()
        self.open: list[socket.socket] = []
        muting = self

        class Forward(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                up = socket.create_connection(("127.0.0.1", port))
                muting.open.append(self.request)
                threading.Thread(target=muting.pipe, args=(up, self.request, self.request), daemon=True).start()
                muting.pipe(self.request, up, self.request)
                up.close()

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Forward)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"{url.rsplit(':', 1)[0]}:{self.server.server_address[1]}/0"

    def pipe(self, src: socket.socket, dst: socket.socket, client: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if client not in self.muted:
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def mute(self) -> None:
        self.muted.update(self.open)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


async def test_a_silent_connection_is_replaced_once_a_ping_goes_unanswered(redis_url: str,
                                                                          make_relay: MakeRelay) -> None:
    """A pub/sub link that goes silent (a partition, a paused node: no error, no close) is given up once a PING
    sent into the silence is unanswered: its streams re-read their event streams and the channels are subscribed
    again on a new connection, within PING_S + PONG_S and a tick, not at the next failed write."""
    muting = Muting(redis_url)
    pub = redis.Redis.from_url(redis_url)
    try:
        relay = await make_relay(muting.url)
        sub = await relay.subscribe("job_muted")
        muting.mute()
        t0 = time.monotonic()
        assert pub.publish(names.job_channel("job_muted"), b"lost") == 1  # sent into the dead path
        assert await _next(sub, PING_S + PONG_S + 3) is None  # re-read the event stream: "lost" is there
        assert time.monotonic() - t0 < PING_S + PONG_S + 2
        deadline = time.monotonic() + 5
        while True:  # until subscribed again on the new connection
            pub.publish(names.job_channel("job_muted"), b"after")
            try:
                got = await _next(sub, 0.1)
                while got is None:  # (asked again once subscribed)
                    got = await _next(sub, 0.1)
                assert got == b"after"
                break
            except TimeoutError:
                assert time.monotonic() < deadline, "the relay did not subscribe again on a new connection"
    finally:
        pub.close()
        muting.close()


async def test_streams_subscribing_while_the_relay_reconnects_to_a_cluster_leave_no_link_behind(
        cluster: LocalCluster, make_relay: MakeRelay, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a failover the relay reconnects and reads the cluster's slot map again, which takes a while as the
    cluster settles; streams that subscribe meanwhile are subscribed once the new links are up, on one link per
    node, and no link of a session is left reading a connection nobody owns (it was: a subscribe in that window
    opened a link that the session then opened again, and the first, orphaned, hung on a closed connection until
    the garbage collector destroyed it, pending, and took the session down with it)."""
    with names.partitions_as(6):
        relay = await make_relay(cluster.seed_url)
        jobs = [names.job_id_in(p, uuid.uuid4().hex) for p in range(6)]  # two partitions a master
        subs = [await relay.subscribe(job_id) for job_id in jobs[:3]]
        manager = type(relay.client.nodes_manager)  # type: ignore[attr-defined]
        settled = manager.initialize
        reading = asyncio.Event()

        async def settling(self: Any, **kwargs: Any) -> None:
            reading.set()
            await asyncio.sleep(0.5)
            await settled(self, **kwargs)

        monkeypatch.setattr(manager, "initialize", settling)
        killer = redis.RedisCluster.from_url(cluster.seed_url)
        primaries = killer.get_primaries()

        async def drop_links(nodes: list[Any]) -> None:
            reading.clear()
            for node in nodes:
                killer.execute_command("CLIENT KILL", "TYPE", "pubsub", target_nodes=node)
            async with asyncio.timeout(10):  # the relay reconnects: it reads the slot map again
                await reading.wait()

        async def all_subscribed() -> None:
            for job_id in jobs:
                deadline = time.monotonic() + 5
                while killer.spublish(names.job_channel(job_id), b"probe") < 1:
                    assert time.monotonic() < deadline, f"{job_id} was never subscribed"
                    await asyncio.sleep(0.05)

        await drop_links(primaries)
        subs += [await relay.subscribe(job_id) for job_id in jobs[3:]]  # while the slot map is read
        await all_subscribed()
        await drop_links(primaries[:1])  # that node's link is opened again, the other two read on
        await all_subscribed()
        links = sorted(t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("relay-link-"))
        assert len(links) == 3, links  # one a node, none left over from the sessions before
        for job_id in jobs:
            killer.spublish(names.job_channel(job_id), b"hello")
        for sub in subs:  # after probes, and a None a reconnect (re-read the event stream)
            got = [await _next(sub)]
            while got[-1] != b"hello" and len(got) < 20:
                got.append(await _next(sub))
            assert got[-1] == b"hello" and set(got) <= {None, b"probe", b"hello"}, (sub.job_id, got)
        killer.close()


async def test_a_lost_link_to_one_cluster_node_leaves_the_other_nodes_streams_alone(cluster: LocalCluster,
                                                                                  make_relay: MakeRelay) -> None:
    """One node's pub/sub link lost (its master failed over, paused, cut off): that node's streams re-read their
    event streams and are subscribed again on a new link, while the other nodes' links and streams carry on as if
    nothing happened: no re-read, no message lost (a lost link used to end every link, and every stream of every
    node re-read its event stream at once)."""
    with names.partitions_as(6):
        relay = await make_relay(cluster.seed_url)
        jobs = [names.job_id_in(p, uuid.uuid4().hex) for p in range(6)]  # on every master
        subs = [await relay.subscribe(job_id) for job_id in jobs]
        killer = redis.RedisCluster.from_url(cluster.seed_url)
        victim = killer.get_primaries()[0]
        links = {t.get_name(): t for t in asyncio.all_tasks() if t.get_name().startswith("relay-link-")}
        assert len(links) == 3, links
        hit = [s for s in subs if killer.get_node_from_key(names.job_channel(s.job_id)).name == victim.name]
        spared = [s for s in subs if s not in hit]
        assert hit and spared
        killer.execute_command("CLIENT KILL", "TYPE", "pubsub", target_nodes=victim)
        for sub in hit:  # what was published while it had no link is in its event stream
            assert await _next(sub) is None
        for sub in hit:  # subscribed again, on a new link
            deadline = time.monotonic() + 5
            while killer.spublish(names.job_channel(sub.job_id), b"probe") < 1:
                assert time.monotonic() < deadline, f"{sub.job_id} was never subscribed again"
                await asyncio.sleep(0.05)
        for job_id in jobs:
            killer.spublish(names.job_channel(job_id), b"hello")
        for sub in spared:  # nothing else came: no re-read asked, no message lost or repeated
            assert await _next(sub) == b"hello" and not sub.items, sub.job_id
        for sub in hit:
            got = [await _next(sub)]
            while got[-1] != b"hello" and len(got) < 50:
                got.append(await _next(sub))
            assert got[-1] == b"hello" and set(got) <= {None, b"probe", b"hello"}, (sub.job_id, got)
        now = {t.get_name(): t for t in asyncio.all_tasks() if t.get_name().startswith("relay-link-")}
        assert now.keys() == links.keys()
        assert [n for n in links if now[n] is not links[n]] == [f"relay-link-{victim.name}"]  # the others kept
        killer.close()


def _move_slot(client: redis.RedisCluster, channel: str) -> int:
    """Move the (key-less) slot of `channel` to another master, as a resharding does; returns the slot."""
    slot = key_slot(channel.encode())
    src = client.get_node_from_key(channel)
    dst = next(n for n in client.get_primaries() if n.name != src.name)
    ids = {n.name: client.execute_command("CLUSTER MYID", target_nodes=n) for n in client.get_primaries()}
    ids = {k: v.decode() if isinstance(v, bytes) else v for k, v in ids.items()}
    client.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", ids[src.name], target_nodes=dst)
    client.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", ids[dst.name], target_nodes=src)
    for node in [dst, src] + [n for n in client.get_primaries() if n.name not in (src.name, dst.name)]:
        client.execute_command("CLUSTER SETSLOT", slot, "NODE", ids[dst.name], target_nodes=node)
    return slot


async def test_a_moved_slots_channels_follow_it_to_its_new_node(cluster: LocalCluster,
                                                               make_relay: MakeRelay) -> None:
    """A resharding moves a slot: its subscribed channels, dropped by their old node, are subscribed on the new
    one (their streams re-read their event streams meanwhile); a channel subscribed by a slot map from before the
    move is answered MOVED, and is routed again rather than left unsubscribed (it was: the stream then lived on
    its 5 s catch-up reads)."""
    with names.partitions_as(6):
        relay = await make_relay(cluster.seed_url)
        pub = redis.RedisCluster.from_url(cluster.seed_url)
        first, second, third = (names.job_id_in(p, uuid.uuid4().hex) for p in (0, 1, 2))

        def links_of(node: str) -> Any:
            return next((t for t in asyncio.all_tasks() if t.get_name() == f"relay-link-{node}"), None)

        async def delivered(sub: Any) -> None:  # published after it is subscribed: it arrives
            deadline = time.monotonic() + 5
            while pub.spublish(names.job_channel(sub.job_id), b"probe") < 1:
                assert time.monotonic() < deadline, f"{sub.job_id} is not subscribed"
                await asyncio.sleep(0.05)
            got = [await _next(sub)]
            while got[-1] != b"probe":
                got.append(await _next(sub))
            assert set(got) <= {None, b"probe"}, got

        sub = await relay.subscribe(first)
        await delivered(sub)
        _move_slot(pub, names.job_channel(first))
        assert await _next(sub) is None  # subscribed again on the new node: re-read what came meanwhile
        await delivered(sub)
        _move_slot(pub, names.job_channel(second))  # a slot the relay has no channel of: its map is stale
        late = await relay.subscribe(second)
        await delivered(late)
        # a slot no node serves (as while a failover settles): the subscription is refused CLUSTERDOWN, and
        # made once the slot is served again
        slot, owner = key_slot(names.job_channel(third).encode()), pub.get_node_from_key(names.job_channel(third))
        held = await relay.subscribe(names.job_id_in(2, uuid.uuid4().hex))  # the owner's link is up
        link = links_of(owner.name)
        assert link is not None
        pub.execute_command("CLUSTER DELSLOTS", slot, target_nodes=owner)
        down = await relay.subscribe(third)
        deadline = time.monotonic() + 5
        while links_of(owner.name) is link:  # refused: that link is given up (and opened again)
            assert time.monotonic() < deadline, "the refusal went unnoticed"
            await asyncio.sleep(0.05)
        pub.execute_command("CLUSTER ADDSLOTS", slot, target_nodes=owner)
        await delivered(down)
        await delivered(held)
        pub.close()


@pytest.mark.parametrize("n", [1, 300])
async def test_streams_share_one_connection(redis_url: str, make_relay: MakeRelay, n: int) -> None:
    relay = await make_relay(redis_url)
    pub = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        before = {c["id"] for c in pub.client_list() if int(c.get("sub", 0)) > 0}
        subs = await asyncio.gather(*(relay.subscribe(f"job_share_{n}_{i}") for i in range(n)))
        port = pub.connection_pool.connection_kwargs["port"]
        ours = {f"127.0.0.1:{c.laddr.port}" for c in psutil.Process().net_connections("tcp")
                if c.raddr and c.raddr.port == port}  # this process's: stacks running beside subscribe too
        new = [int(c["sub"]) for c in pub.client_list()
               if int(c.get("sub", 0)) > 0 and c["id"] not in before and c["addr"] in ours]
        assert new == [n]
        pipe = pub.pipeline()
        for i in range(n):
            pipe.publish(names.job_channel(f"job_share_{n}_{i}"), str(i))
        assert pipe.execute() == [1] * n
        assert [await _next(s) for s in subs] == [str(i).encode() for i in range(n)]
    finally:
        pub.close()


class NeverConfirms(socketserver.StreamRequestHandler):
    """A Redis node that answers a connection's setup and the client's probe (INFO: not a cluster) but
    never (un)subscribes: a subscription sent to it is never confirmed."""

    def handle(self) -> None:
        while (head := self.rfile.readline()).startswith(b"*"):
            args = [self.rfile.read(int(self.rfile.readline()[1:]) + 2)[:-2] for _ in range(int(head[1:]))]
            command = args[0].upper()
            if command == b"HELLO":  # RESP3
                self.wfile.write(b"%1\r\n$5\r\nproto\r\n:3\r\n")
            elif command == b"INFO":
                self.wfile.write(b"$19\r\ncluster_enabled:0\r\n\r\n")
            elif not command.endswith(b"SUBSCRIBE"):
                self.wfile.write(b"+PONG\r\n" if command == b"PING" else b"+OK\r\n")


async def test_stream_cancelled_while_subscribing_leaves_nothing_behind(make_relay: MakeRelay) -> None:
    # on a thread of its own: the client's probe (a blocking call) waits on it from this event loop
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), NeverConfirms)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        relay = await make_relay(f"redis://127.0.0.1:{server.server_address[1]}/0", wait_s=0.1)
        task = asyncio.create_task(relay.subscribe("job_gone"))
        await asyncio.sleep(0.2)
        assert relay.active == 1 and not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert relay.active == 0 and not relay.subs
    finally:
        server.shutdown()
        server.server_close()
