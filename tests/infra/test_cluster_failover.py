"""The output lane writes through a master's failover: kill -9 of a master (not the seed the lane was
given first) while the lane streams jobs spread over every master; the write that met the dead node is
sent again against a fresh slot map, the lane gets every job's text and end through, and no chunk is lost
or repeated. Twice in a row, on two masters. And a REDIS_URL that lists a dead node first still finds the
cluster through the next. Needs Debian's redis-server 7.0 (skips without it); the
cluster is the test's own. bench.chaos
--failover runs the same kill against a whole stack, 20 times in a row."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pyarrow as pa
import pytest
import redis
from tokenizers import Tokenizer

from gpu_worker.messages import DELTA_SCHEMA, Done, Ended, LaneReport, Register
from gpu_worker.output_lane import OutputLane
from infra.redis_cluster import LocalCluster, cluster_binary
from infra.redis_server import free_port
from shared import fence, names
from shared.job_ops import AsyncJobOps, NotCopied, Writes, execute_copied
from shared.jobs import JobStatus, new_record
from shared.redis_client import async_client, is_cluster, sync_client
from shared.schemas import to_ipc
from shared.scripts.codes import SubmitCode, SubmitReply
from shared.settings import Settings
from workers.batch_driver import BatchDriver

PARTITIONS = 12
LAGGING_S = 2.5  # shared/fence.py's, shortened: how long a paused replica is waited on
JOBS = 24
TEXT = "The capital of France is Paris. It is known for the Eiffel Tower, for its museums and for fine food."
WORKER = "inference-test-1"


@pytest.mark.slow
def test_the_output_lane_writes_through_a_masters_failover(tmp_path: Path, model_path: str) -> None:
    try:
        cluster_binary()
    except SystemExit as e:
        pytest.skip(str(e))  # no redis-server 7
    cluster = LocalCluster(tmp_path / "cluster", masters=3, replicas=1)
    try:
        cluster.start(timeout=30)
        with names.partitions_as(PARTITIONS):
            a_jobs_end_is_done_only_once_a_replica_has_it(cluster, model_path)
            a_batchs_end_leaves_the_drivers_only_once_a_replica_has_it(cluster)
            a_master_whose_replica_died_is_waited_on_once(cluster)
            a_job_whose_master_died_with_steps_no_replica_had_goes_on(cluster, model_path)
            a_master_refusing_writes_holds_only_its_own_streams(cluster, model_path)
            for round_ in range(2):
                stream_through_a_kill(cluster, model_path, round_)
            asyncio.run(a_submit_whose_connection_failed_is_never_confirmed_by_another_node(cluster))
        a_seed_list_finds_the_cluster_past_a_dead_node(cluster)
        asyncio.run(a_promise_across_a_failover_the_slot_map_missed_is_a_retry(cluster))
    finally:
        cluster.stop()


def stream_through_a_kill(cluster: LocalCluster, model_path: str, round_: int) -> None:
    ids = Tokenizer.from_file(f"{model_path}/tokenizer.json").encode(TEXT, add_special_tokens=False).ids
    client, feedback, lane = _lane(cluster, model_path)
    jobs = [names.job_id_in(i % PARTITIONS, uuid.uuid4().hex) for i in range(JOBS)]
    for job_id in jobs:
        created = _running(client, job_id)
        lane.register(Register(job_id, (), created, prompt_tokens=3, started=True, worker=WORKER))
    seed_port = int(cluster.url.rsplit(":", 1)[1].split("/")[0])
    victim = next(p for p in cluster.master_ports() if p != seed_port)
    steps_done = [0]

    # the jobs end one after another from a third of the way on, so that the steps in flight when the master
    # dies carry ends (and their WAIT for a replica, sent to the node that holds each job)
    lengths = {j: len(ids) // 3 + 1 + i % (len(ids) - len(ids) // 3 - 1) for i, j in enumerate(jobs)}

    def feed() -> None:
        for t, token in enumerate(ids):
            rows = [{"job_id": j, "token_ids": [token], "finish_reason": "length" if t == n - 1 else None,
                     "error": None} for j, n in lengths.items() if t < n]
            lane.handle_deltas(to_ipc(pa.RecordBatch.from_pylist(rows, schema=DELTA_SCHEMA)))
            steps_done[0] = t + 1

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    deadline = time.monotonic() + 30
    while steps_done[0] < len(ids) // 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    cluster.kill(victim)  # a third of the way through: the lane's next writes to it meet a dead node, which
    feeder.join(90)  # stays dead: an operator's restart may take minutes
    assert not feeder.is_alive(), f"round {round_}: the lane stalled at step {steps_done[0]} of {len(ids)}"
    assert lane.wait_ends(30), f"round {round_}: ends never confirmed: {sorted(lane.ending)}"
    lane.close()
    ended = {r.job_id for r in _drain(feedback) if isinstance(r, Done)}
    assert ended == set(jobs)
    for job_id in jobs:
        rec = client.hgetall(names.job_key(job_id))
        assert rec[b"status"] == b"succeeded", (job_id, rec)
        text = Tokenizer.from_file(f"{model_path}/tokenizer.json").decode(ids[:lengths[job_id]])
        assert client.get(names.text_key(job_id)).decode() == text
        events = client.xrange(names.events_key(job_id))
        tokens = [f for _, f in events if f[b"type"] == b"token"]
        seqs = [int(eid.decode().split("-")[1]) for eid, f in events if f[b"type"] == b"token"]
        assert seqs == list(range(1, len(seqs) + 1)), (job_id, seqs)  # no gap, no repeat
        assert b"".join(f[b"text"] for f in tokens).decode() == text
    cluster.wait_ok(timeout=30)
    cluster.restart_node(victim)  # back as a replica: the next round has three masters with replicas again
    cluster.wait_ok(timeout=30)
    until = time.monotonic() + 30
    while victim not in cluster.replica_ports() and time.monotonic() < until:
        time.sleep(0.1)
    client.close()


def a_master_refusing_writes_holds_only_its_own_streams(cluster: LocalCluster, model_path: str) -> None:
    """A master (not the seed) refuses every write (too few replicas: NOREPLICAS) while the lane streams a job in
    every partition: the jobs on the other masters stream to their ends and are Done meanwhile, those on the
    refusing master wait, running, their writes held in order; once it takes writes again, they end too, their
    text whole and their event streams' seqs 1..n. Before, every step waited on the refused writes: no job of any
    master streamed until the refusal ended."""
    tokenizer = Tokenizer.from_file(f"{model_path}/tokenizer.json")
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids[:12]
    client, feedback, lane = _lane(cluster, model_path)
    jobs = [names.job_id_in(p, uuid.uuid4().hex) for p in range(PARTITIONS)]
    for job_id in jobs:
        lane.register(Register(job_id, (), _running(client, job_id), prompt_tokens=3, started=True, worker=WORKER))
    seed_port = int(cluster.url.rsplit(":", 1)[1].split("/")[0])
    victim = next(p for p in cluster.master_ports() if p != seed_port)
    held = [j for j in jobs if client.get_node_from_key(names.job_key(j)).port == victim]
    others = [j for j in jobs if j not in held]
    assert held and others

    def step(t: int) -> None:
        rows = [{"job_id": j, "token_ids": [ids[t]], "finish_reason": "length" if t == len(ids) - 1 else None,
                 "error": None} for j in jobs]
        lane.handle_deltas(to_ipc(pa.RecordBatch.from_pylist(rows, schema=DELTA_SCHEMA)))

    def feed() -> None:
        for t in range(1, len(ids)):
            step(t)

    node = cluster.node(victim).client()
    try:
        step(0)
        node.config_set("min-replicas-to-write", len(cluster.replica_ports()) + 1)
        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        feeder.join(30)
        assert not feeder.is_alive(), "the lane's steps waited on the refusing master"
        reports: list[LaneReport] = []
        until = time.monotonic() + 30
        while not {Done(j) for j in others} <= set(reports):
            assert time.monotonic() < until, f"the other masters' jobs did not end: {reports}"
            lane.catch_up()  # as the lane's loop does
            lane.refence()
            reports += _drain(feedback)
            time.sleep(0.01)
        for job_id in held:  # nothing ended meanwhile, nothing written past the first step
            assert client.hget(names.job_key(job_id), "status") == JobStatus.running.value.encode()
            assert client.hget(names.job_key(job_id), "completion_tokens") == b"1"
        assert not any(isinstance(r, Done) and r.job_id in held for r in reports)
        node.config_set("min-replicas-to-write", 0)
        assert lane.wait_ends(30), "the held writes never went through"
        reports += _drain(feedback)
        assert {r.job_id for r in reports if isinstance(r, Done)} == set(jobs)
        for job_id in jobs:
            assert client.hget(names.job_key(job_id), "status") == JobStatus.succeeded.value.encode()
            assert client.get(names.text_key(job_id)).decode() == tokenizer.decode(ids)
            events = client.xrange(names.events_key(job_id))
            seqs = [int(eid.decode().split("-")[1]) for eid, f in events if f[b"type"] == b"token"]
            assert seqs == list(range(1, len(ids) + 1)), (job_id, seqs)  # a chunk a step, none lost or repeated
    finally:
        node.config_set("min-replicas-to-write", 0)
        node.close()
        lane.close()
        client.close()


def a_job_whose_master_died_with_steps_no_replica_had_goes_on(cluster: LocalCluster, model_path: str) -> None:
    """A running job's master copies its first steps to its replica, then loses the link to it (the replica paused,
    its connection killed) and writes the next step alone; killed then, its replica (running again) is promoted
    without that step. The lane's next step finds the hole (a gap); it writes the lost step again, then its own,
    and the job ends succeeded, its text whole and its event stream's seqs 1..n. Before, the job failed as
    incomplete ("part of the output was not recorded")."""
    tokenizer = Tokenizer.from_file(f"{model_path}/tokenizer.json")
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids[:8]
    client, feedback, lane = _lane(cluster, model_path)
    job_id = names.job_id_in(3, uuid.uuid4().hex)
    key = names.job_key(job_id)
    created = _running(client, job_id)
    lane.register(Register(job_id, (), created, prompt_tokens=3, started=True, worker=WORKER))

    def step(tokens: list[int], reason: str | None = None) -> None:
        rows = [{"job_id": job_id, "token_ids": tokens, "finish_reason": reason, "error": None}]
        lane.handle_deltas(to_ipc(pa.RecordBatch.from_pylist(rows, schema=DELTA_SCHEMA)))

    master = client.get_node_from_key(key).port
    replica = cluster.replica_of(master)
    try:
        step(ids[:2])
        step(ids[2:4])
        with cluster.node(master).client() as c:
            assert c.execute_command("WAIT", 1, 5000) == 1  # the replica has the steps so far
            cluster.kill(replica, signal.SIGSTOP)
            c.client_kill_filter(_type="replica")
        step(ids[4:6])  # on the master alone
        cluster.kill(master)
        cluster.kill(replica, signal.SIGCONT)
        step(ids[6:7])  # meets the dead node, then (promoted) the replica without the step before it
        step(ids[7:8], "length")
        assert lane.wait_ends(30)
        assert [r for r in _drain(feedback) if isinstance(r, Done)] == [Done(job_id)]
        rec = client.hgetall(key)
        assert rec[b"status"] == b"succeeded", rec
        text = tokenizer.decode(ids)
        assert client.get(names.text_key(job_id)).decode() == text
        events = client.xrange(names.events_key(job_id))
        seqs = [int(eid.decode().split("-")[1]) for eid, f in events if f[b"type"] == b"token"]
        assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) == 5  # a chunk a step
        assert b"".join(f[b"text"] for _, f in events if f[b"type"] == b"token").decode() == text
    finally:
        lane.close()
        client.close()
        if master in cluster.dead_nodes():
            cluster.wait_ok(timeout=30)
            cluster.restart_node(master)  # back as a replica
        cluster.wait_ok(timeout=30)
        cluster.wait_in_sync()


def a_jobs_end_is_done_only_once_a_replica_has_it(cluster: LocalCluster, model_path: str) -> None:
    """The output lane reports a job Done (its stream entry is acknowledged next) only once a replica of its
    master has the job's end. Its master's replica paused, the lane asks again and again and reports nothing, but
    not for as long as the pause lasts: past LAGGING_S (shortened here) the master is taken to have no replica, and
    the job is Done. Once the replica runs, it has the job ended. Meanwhile the lane's output goes on: the step
    that ended the job returned at once, and a job on another master streams and ends, Done, while the first
    job's end still waits. Before, the lane waited in that step: every job's output stalled for LAGGING_S (5 s)."""
    client, feedback, lane = _lane(cluster, model_path)
    job_id = names.job_id_in(0, uuid.uuid4().hex)
    master = client.get_node_from_key(names.job_key(job_id)).port
    other = next(j for j in (names.job_id_in(p, uuid.uuid4().hex) for p in range(1, PARTITIONS))
                 if client.get_node_from_key(names.job_key(j)).port != master)
    for job in (job_id, other):
        lane.register(Register(job, (), _running(client, job), prompt_tokens=3, started=True, worker=WORKER))

    def step(job: str, reason: str | None = None) -> None:
        rows = [{"job_id": job, "token_ids": [42], "finish_reason": reason, "error": None}]
        lane.handle_deltas(to_ipc(pa.RecordBatch.from_pylist(rows, schema=DELTA_SCHEMA)))

    try:
        with replica_paused(cluster, client, names.job_key(job_id)) as (master, replica):
            def waits() -> int:
                with cluster.node(master).client() as c:
                    return int(c.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))

            before = waits()
            reports: list[LaneReport] = []
            with mock.patch.object(fence, "LAGGING_S", LAGGING_S):
                started = time.monotonic()
                step(job_id, "length")
                # its slot free at once (the engine has finished it), its Done waiting for a replica
                assert _drain(feedback) == [Ended(job_id)], "the step waited for a replica, or Done came before one"
                step(other)  # the lane's output goes on: another job streams and ends on its own master
                step(other, "length")
                until = time.monotonic() + 30
                while Done(job_id) not in reports:
                    assert time.monotonic() < until, reports
                    lane.catch_up()  # as the lane's loop does
                    lane.refence()
                    reports += [r for r in _drain(feedback) if not isinstance(r, Ended)]
                    time.sleep(0.01)
                assert reports == [Done(other), Done(job_id)], "an end on a healthy master waited for another's"
                assert time.monotonic() - started >= LAGGING_S
                assert waits() >= before + 2  # it asked, and asked again
            assert client.hget(names.job_key(other), "status") == JobStatus.succeeded.value.encode()
            cluster.kill(replica, signal.SIGCONT)
            until = time.monotonic() + 30
            with cluster.node(replica).client() as c:
                c.execute_command("READONLY")
                while c.hget(names.job_key(job_id), "status") != JobStatus.succeeded.value:
                    assert time.monotonic() < until
                    time.sleep(0.05)
    finally:
        lane.close()
        client.close()


def a_batchs_end_leaves_the_drivers_only_once_a_replica_has_it(cluster: LocalCluster) -> None:
    """An ended batch leaves the drivers' set only once a replica of its record's master has its end: its master's
    replica paused, closing the batch is NotCopied and the batch stays for the next tick; once the replica runs,
    it closes, and the replica has the batch ended. Before, a failover right then could leave the batch
    `in_progress` on the promoted replica, with no driver to end it."""
    client = sync_client(cluster.seed_url)
    batch_id = f"batch_{uuid.uuid4().hex}"
    key = names.batch_key(batch_id)
    client.hset(key, mapping={"status": "in_progress", "owner": ""})
    client.sadd(names.BATCHES_ACTIVE, batch_id)
    driver = BatchDriver(client, Settings(redis_url=cluster.seed_url))
    try:
        with replica_paused(cluster, client, key) as (_, replica):
            client.hset(key, "status", "completed")  # the batch ended (as the driver's _finish records it)
            with pytest.raises(NotCopied):
                driver.advance(batch_id)
            assert client.sismember(names.BATCHES_ACTIVE, batch_id)
            cluster.kill(replica, signal.SIGCONT)
            until = time.monotonic() + 30
            while True:
                try:
                    driver.advance(batch_id)
                    break
                except NotCopied:
                    assert time.monotonic() < until
            assert not client.sismember(names.BATCHES_ACTIVE, batch_id)
            with cluster.node(replica).client() as c:
                c.execute_command("READONLY")
                assert c.hget(key, "status") == "completed"
    finally:
        client.close()


def a_master_whose_replica_died_is_waited_on_once(cluster: LocalCluster) -> None:
    """A replica killed (its master sees its link close), still listed by the cluster until its node timeout has
    passed: the first fence after it waits one WAIT and takes the master for one without a replica; the next ones
    ask ROLE, not WAIT, until a replica is connected again. Before, every fence waited a WAIT and failed (NotCopied)
    for LAGGING_S: the output lane's whole output stalled with it, 5 s after each replica's crash or restart."""
    client = sync_client(cluster.seed_url, decode=False)
    key = names.job_key(names.job_id_in(1, uuid.uuid4().hex))
    writer = fence.Fence(client)
    try:
        client.set(key, 1)
        writer.confirm([key])
        with replica_paused(cluster, client, key, signal.SIGKILL) as (master, _):
            with cluster.node(master).client() as c:
                until = time.monotonic() + 30
                while c.execute_command("ROLE")[2]:  # until the master has seen the link close
                    assert time.monotonic() < until
                    time.sleep(0.02)

                def waits() -> int:
                    return int(c.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))

                before = waits()
                client.set(key, 2)
                with mock.patch.object(fence, "ALONE_RECHECK_S", 0.0):  # asked again at each call
                    writer.confirm([key])  # no NotCopied: nothing would ever confirm it
                    assert waits() == before + 1
                    writer.confirm([key])
                    writer.confirm([key])
                assert waits() == before + 1  # asked again with ROLE: still none connected
                assert writer.alone
    finally:
        client.close()


@contextlib.contextmanager
def replica_paused(cluster: LocalCluster, client: redis.cluster.RedisCluster, key: str,
                   sig: int = signal.SIGSTOP) -> Iterator[tuple[int, int]]:
    """The replica of `key`'s master paused (SIGSTOP), or killed (SIGKILL), while the cluster still lists it (every
    node's CLUSTER SLOTS does, and the client's slot map; its node timeout raised meanwhile, so that it is not
    failed); (master, replica) ports. Afterwards it runs again (a killed one is started again), and every replica
    is back on its link."""
    master = client.get_node_from_key(key).port
    replica = cluster.replica_of(master)
    ports = [n.port for n in cluster.nodes]
    slot = client.keyslot(key)

    def listed(port: int) -> bool:  # (a replica is listed once it has copied a write: the test's first)
        with cluster.node(port).client() as c:
            return any(int(r[0]) <= slot <= int(r[1]) and any(int(n[1]) == replica for n in r[3:])
                       for r in c.execute_command("CLUSTER", "SLOTS"))

    until = time.monotonic() + 30
    while not all(listed(port) for port in ports):
        assert time.monotonic() < until
        time.sleep(0.05)
    client.nodes_manager.initialize()
    for port in ports:
        with cluster.node(port).client() as c:
            c.config_set("cluster-node-timeout", 60_000)
    cluster.kill(replica, sig)
    try:
        yield master, replica
    finally:
        if sig == signal.SIGKILL:
            cluster.restart_node(replica)
        else:
            cluster.kill(replica, signal.SIGCONT)
        for port in ports:
            with cluster.node(port).client() as c:
                c.config_set("cluster-node-timeout", cluster.node_timeout_ms)
    cluster.wait_in_sync()


def _lane(cluster: LocalCluster, model_path: str) -> tuple[redis.Redis, queue.SimpleQueue[LaneReport], OutputLane]:
    """A cluster client, and an output lane writing with it whose reports go to the queue."""
    client = sync_client(cluster.seed_url, decode=False)
    feedback: queue.SimpleQueue[LaneReport] = queue.SimpleQueue()
    lane = OutputLane(Settings(redis_url=cluster.seed_url, model=model_path), feedback,  # type: ignore[arg-type]
                      client=client)
    return client, feedback, lane


def _running(client: redis.Redis, job_id: str) -> float:
    """A running job of WORKER's, its record on a replica too; its creation time."""
    record = new_record(job_id, "m", "{}") | {"status": JobStatus.running.value, "worker": WORKER}
    pipe = client.pipeline(transaction=False)  # the record, and a WAIT on its connection: a replica has it
    pipe.hset(names.job_key(job_id), mapping=record)
    pipe.execute_command("WAIT", 1, 5000, target_nodes=client.get_node_from_key(names.job_key(job_id)))
    assert pipe.execute()[1] == 1
    return float(record["created_at"])


def a_seed_list_finds_the_cluster_past_a_dead_node(cluster: LocalCluster) -> None:
    """A process that starts while the first node REDIS_URL lists is down still finds the cluster through the
    next one (the first here is a port nothing listens on), and takes it for a cluster."""
    url = cluster.url.replace(f":{cluster.nodes[0].port}/", f":{free_port()}/") + f",127.0.0.1:{cluster.nodes[1].port}"
    assert is_cluster(url)
    client = sync_client(url)
    try:
        client.set("{seed}:k", "v")
        assert client.get("{seed}:k") == "v"
        assert len(client.get_primaries()) == 3  # every node discovered from the one that answered
    finally:
        client.close()


async def a_promise_across_a_failover_the_slot_map_missed_is_a_retry(cluster: LocalCluster) -> None:
    """A promised write (execute_copied: the writes, then WAIT, on one connection to their master) sent while the
    client's slot map still names a master that a failover made a replica: the old master answers MOVED, nothing
    is written, and that is NotCopied (a retryable 503 at the door), never a raised ResponseError (a 500) nor a
    WAIT counted on the wrong node. The next promise, on the refreshed map, is confirmed."""
    key = f"{{promise}}:{uuid.uuid4().hex}"
    client = async_client(cluster.url)
    try:
        await client.initialize()  # type: ignore[union-attr]
        old = client.get_node_from_key(key)  # type: ignore[union-attr]
        with cluster.node(cluster.replica_of(old.port)).client() as c:
            c.execute_command("CLUSTER", "FAILOVER")  # the replica takes over; the old master follows it
        until = time.monotonic() + 30
        while old.port not in cluster.replica_ports() and time.monotonic() < until:
            time.sleep(0.1)
        assert old.port in cluster.replica_ports()
        writes = Writes()
        writes.set(key, "first")
        with pytest.raises(NotCopied):
            await execute_copied(client, writes)  # type: ignore[arg-type]
        writes = Writes()
        writes.set(key, "second")
        replies, copied = await execute_copied(client, writes)  # type: ignore[arg-type]
        assert replies == ["OK"] and copied
        assert await client.get(key) == "second"
    finally:
        await client.aclose()


async def a_submit_whose_connection_failed_is_never_confirmed_by_another_node(cluster: LocalCluster) -> None:
    """A submit whose connection to its master fails (its sockets destroyed), its master's replica stopped: the
    API answers a retryable error, never a 202. A cluster pipeline sends a command
    that failed again on its own, and the WAIT sent again lost its node: it went to another master, which answered
    for a connection that wrote nothing, and promised a job that no replica had. Then, the replica still stopped,
    the same submit is NotCopied; once the replica runs again, it is answered and the replica has the job."""
    client = async_client(cluster.url)
    replica = 0
    try:
        await client.initialize()  # type: ignore[union-attr]
        default = client.get_default_node()  # type: ignore[union-attr]
        key, job_id = next((k, j) for k, j in ((k, names.job_id_in(names.new_job_partition("", k), uuid.uuid4().hex))
                                               for k in (f"idem-{i}" for i in range(64)))
                           if client.get_node_from_key(names.job_key(j)) != default)  # type: ignore[union-attr]
        master = client.get_node_from_key(names.job_key(job_id))  # type: ignore[union-attr]
        replica = cluster.replica_of(master.port)
        cluster.kill(replica, signal.SIGSTOP)
        await client.hget(names.job_key(job_id), "status")  # a connection to the master, in the client's pool
        # its sockets to the master destroyed on this side (the next write on them fails); else, where the kernel
        # cannot (no sock_destroy), the master drops them (the next read fails: no resend either way)
        ss = subprocess.run(["ss", "-K", "-t", "dst", "127.0.0.1", "dport", "=", f":{master.port}"],
                            capture_output=True, text=True, check=False)
        if ss.returncode != 0 or "ESTAB" not in ss.stdout:
            with cluster.node(master.port).client() as c:
                c.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        ops, request = AsyncJobOps(client, 60), '{"prompt": "hi"}'  # type: ignore[arg-type]

        async def submit() -> SubmitReply:
            return await ops.submit(job_id, new_record(job_id, "m", request), request, idempotency_key=key,
                                    idempotency_ttl_s=60)

        with pytest.raises(redis.exceptions.ConnectionError):
            await submit()
        with pytest.raises(NotCopied):
            await submit()
        cluster.kill(replica, signal.SIGCONT)
        until = time.monotonic() + 30
        while True:
            try:
                got = await submit()
                break
            except NotCopied:
                assert time.monotonic() < until
        assert got.code in (SubmitCode.accepted, SubmitCode.replay)
        with cluster.node(replica).client() as c:
            c.execute_command("READONLY")
            assert c.hget(names.job_key(job_id), "status") == "queued"
    finally:
        if replica:
            cluster.kill(replica, signal.SIGCONT)
        await client.aclose()
    cluster.wait_in_sync()  # its replica back on its link (ss -K cut it too): the failover below needs it


def _drain(feedback: queue.SimpleQueue[LaneReport]) -> list[LaneReport]:
    out = []
    while not feedback.empty():
        out.append(feedback.get_nowait())
    return out
