"""The scripts on a real Redis Cluster (3 masters), called as the stages call them: a cluster client sends each
call to the slot of its KEYS and refuses KEYS of several slots, so a job's whole life here shows every call's
keys in one slot; a queued job's cancel leaves the fair queue, and a finish names its owner's keys; an idle consumer
of every partition sleeps on its ring and an append in any partition wakes it (shared/ring.py)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import pytest
import redis

from infra.redis_cluster import LocalCluster
from shared import fair_queue, names, scripts
from shared.fair_queue import FairQueue
from shared.job_ops import FIRST_TOKEN, FRESH, JobOps, pack_ids, step_write, submit_write
from shared.jobs import FinishReason, new_record
from shared.redis_client import sync_client
from shared.redis_errors import WritesRefusedError
from shared.scripts.codes import FinishCode, FinishReply, StartCode, StepCode, StepReply, SubmitCode, SubmitReply
from shared.stream_consumer import StreamConsumer
from tests.helpers import master_of, partitions_elsewhere, until

T = TypeVar("T")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[redis.Redis]:
    nodes = LocalCluster(tmp_path_factory.mktemp("scripts-cluster"), masters=3, replicas=0, appendfsync="no")
    nodes.start()
    client = sync_client(nodes.seed_url, decode=False)
    yield client
    client.close()
    nodes.stop()


def _submit(r: redis.Redis, job_id: str, owner: str) -> None:
    record = {k: v for k, v in new_record(job_id, "m", "{}").items() if k != "request"}
    write = submit_write(job_id, record, "{}", 60, owner=owner, reserve_tokens=40)
    assert SubmitReply.parse(scripts.SUBMIT(r, *write)).code is SubmitCode.accepted


def test_a_job_runs_its_whole_life_on_a_cluster(cluster: redis.Redis) -> None:
    r, owner = cluster, "acme-cluster"
    p = names.tenant_partition(owner)
    r.hset(names.tenant_key(owner), mapping={"disabled": "0", "rpm": 0, "tpm": 100, "max_queued": 0})
    r.xgroup_create(names.stream(names.TOKENIZED, p), names.INFERENCE_GROUP, id="0", mkstream=True)
    ops, job_id = JobOps(r, 60), names.job_id_in(p, "a1" * 16)
    _submit(r, job_id, owner)
    assert fair_queue.push(r, p, [], [(job_id, 0, 10, b"row")]) == 1
    [entry] = FairQueue(r, "w").pop(4, None)
    assert entry.fields[b"batch"] == b"row"
    took = ops.start(job_id, "w")
    assert (took.code, took.owner) == (StartCode.started, owner)
    keys, args = step_write(job_id, FRESH | FIRST_TOKEN, 0, pack_ids([7]), 0, b"Hi", 1, b"{}", 1, worker="w",
                             charge=(owner, 2.0, 1))
    pipe = r.pipeline(transaction=False)
    ops.step(keys, args, pipe)
    ops.finish(job_id, FinishReason.stop, fields={"completion_tokens": 1}, pipe=pipe, worker="w", owner=took.owner)
    step, end = pipe.execute()
    assert StepReply.parse(step).codes == (StepCode.written,) and FinishReply.parse(end) == FinishReply(
        FinishCode.finished, 2)
    assert r.get(names.text_key(job_id)) == b"Hi" and r.get(names.tenant_active_key(owner)) == b"0"
    assert float(r.hget(names.fair_key(p, "vtc"), owner)) == 12.0  # 10 prompt tokens, then 2 for the token


def test_a_queued_job_cancelled_on_a_cluster_leaves_the_fair_queue(cluster: redis.Redis) -> None:
    r, owner = cluster, "other-cluster"
    p = names.tenant_partition(owner)
    r.hset(names.tenant_key(owner), mapping={"disabled": "0", "rpm": 0, "tpm": 0, "max_queued": 0})
    ops, job_id = JobOps(r, 60), names.job_id_in(p, "b2" * 16)
    _submit(r, job_id, owner)
    assert fair_queue.push(r, p, [], [(job_id, 0, 10, b"row")]) == 1
    assert fair_queue.waiting_jobs(r, p, owner) == [job_id]
    got = ops.finish(job_id, FinishReason.cancelled, required_status="queued", owner="not-the-owner")
    assert got == FinishReply(FinishCode.finished, 1)  # refused as owner_changed, then named from the record
    assert fair_queue.waiting_jobs(r, p, owner) == [] and r.zscore(names.fair_key(p, "tenants"), owner) is None
    assert r.get(names.tenant_active_key(owner)) == b"0"


def _flags(r: redis.Redis, group: str, model: str = "") -> int:
    return sum(bool(r.exists(names.ring_key(p, group, model))) for p in names.partitions())


def _in_thread(call: Callable[[], T]) -> Future[T]:
    pool = ThreadPoolExecutor(1)
    future = pool.submit(call)
    pool.shutdown(wait=False)
    return future


@pytest.fixture
def twelve() -> Iterator[None]:
    with names.partitions_as(12):  # a 3-master cluster's (`conveyor up --redis-cluster 3`)
        yield


@pytest.mark.usefixtures("twelve")
def test_an_idle_tokenizer_sleeps_on_its_ring_and_a_submit_in_any_partition_wakes_it(cluster: redis.Redis) -> None:
    """A read with nothing to take arms every partition's flag and waits on the ring (one subscription, not a turn
    over the partitions); the submit takes its partition's flag and rings, and the same read returns the job, long
    before its block time. Idle again, it sets only the flag taken. A read that finds work arms nothing."""
    r = cluster
    consumer = StreamConsumer(r, names.streams(names.JOBS), names.TOKENIZER_GROUP, "tok-1", names.TOKENIZER_POOL)
    consumer.ensure_group()
    while old := consumer.read(100, block_ms=None):  # the other tests' jobs
        consumer.ack([e.ref for e in old])
    p, job_id = 5, names.job_id_in(5, "c3" * 16)
    reading = _in_thread(lambda: consumer.read(10, block_ms=60_000))
    until("every partition's flag armed", lambda: _flags(r, names.TOKENIZER_GROUP) == names.partition_count(), 10)
    _submit(r, job_id, "")
    [entry] = reading.result(timeout=30)
    assert entry.fields[b"job_id"] == job_id.encode() and names.stream_partition(entry.stream) == p
    assert not r.exists(names.ring_key(p, names.TOKENIZER_GROUP))  # taken by the submit that rang
    assert _flags(r, names.TOKENIZER_GROUP) == names.partition_count() - 1
    consumer.ack([entry.ref])
    reading = _in_thread(lambda: consumer.read(10, block_ms=60_000))  # idle again: the flag taken is set again
    until("the flag taken set again", lambda: r.exists(names.ring_key(p, names.TOKENIZER_GROUP)), 10)
    _submit(r, names.job_id_in(7, "d4" * 16), "")
    [entry] = reading.result(timeout=30)
    consumer.ack([entry.ref])
    for key in consumer.ring.keys:  # the others expire (ARMED_MS); a busy read sets none
        r.delete(key)
    _submit(r, names.job_id_in(8, "f6" * 16), "")
    assert len(consumer.read(10, block_ms=60_000)) == 1 and _flags(r, names.TOKENIZER_GROUP) == 0
    consumer.ring.close()


@pytest.mark.usefixtures("twelve")
def test_an_idle_inference_worker_is_woken_by_a_job_queued_in_any_partition(cluster: redis.Redis) -> None:
    r, p = cluster, 9
    for q in names.partitions():
        r.xgroup_create(names.stream(names.TOKENIZED, q, "other"), names.INFERENCE_GROUP, id="0", mkstream=True)
    queue = FairQueue(r, "w-ring", model="other")
    job_id = names.job_id_in(p, "e5" * 16)
    r.hset(names.job_key(job_id), mapping={"status": "queued"})
    popping = _in_thread(lambda: queue.pop(4, block_ms=60_000))
    until("every partition's flag armed", lambda: _flags(r, names.INFERENCE_GROUP, "other") == names.partition_count(),
          10)
    assert fair_queue.push(r, p, [], [(job_id, 0, 10, b"row")], model="other") == 1
    [entry] = popping.result(timeout=30)
    assert entry.fields[b"batch"] == b"row"
    queue.ring.close()


@pytest.mark.usefixtures("twelve")
def test_a_master_refusing_writes_holds_back_only_its_own_partitions_jobs(cluster: redis.Redis) -> None:
    """One master refuses writes (too few replicas: NOREPLICAS): a tokenizer's read and an inference worker's pop,
    each over every partition, take the jobs of the other masters' partitions, and the refused partition's job
    once its master takes writes again. Before, the refusal failed the whole read: no job of any partition went on,
    and those read from partitions before it were left pending, unseen, until they idled out."""
    r, model = cluster, "refusing"
    refusing, other = master_of(r, 0), partitions_elsewhere(r, 0)[0]
    for q in names.partitions():
        r.xgroup_create(names.stream(names.TOKENIZED, q, model), names.INFERENCE_GROUP, id="0", mkstream=True)
    streams = [names.stream(names.JOBS, q, model) for q in names.partitions()]
    consumer = StreamConsumer(r, streams, "refusal-tokenizers", "tok-r", names.TOKENIZER_POOL)
    consumer.ensure_group()
    queue = FairQueue(r, "w-refused", model=model)
    held, free = names.job_id_in(0, uuid.uuid4().hex), names.job_id_in(other, uuid.uuid4().hex)
    for job_id in (held, free):
        r.xadd(names.stream(names.JOBS, names.job_partition(job_id), model), {"job_id": job_id})
        r.hset(names.job_key(job_id), mapping={"status": "queued"})
        assert fair_queue.push(r, names.job_partition(job_id), [], [(job_id, 0, 10, job_id.encode())], model=model)
    node = r.get_redis_connection(refusing)
    node.config_set("min-replicas-to-write", 1)
    try:
        with pytest.raises(WritesRefusedError):
            node.set(names.job_key(held), "x")  # (it does refuse)
        assert [e.fields[b"job_id"] for e in consumer.read(10, block_ms=None)] == [free.encode()]
        assert [e.fields[b"batch"] for e in queue.pop(4, None)] == [free.encode()]
    finally:
        node.config_set("min-replicas-to-write", 0)
    assert [e.fields[b"job_id"] for e in consumer.read(10, block_ms=None)] == [held.encode()]
    assert [e.fields[b"batch"] for e in queue.pop(4, None)] == [held.encode()]
    consumer.ring.close()
    queue.ring.close()


def test_upkeeps_consumer_pruning_and_a_batch_cancel_run_on_a_cluster(cluster: redis.Redis) -> None:
    """The scripts upkeep and the Batch API's cancel call, on a cluster: each stream's group on its own master, the
    cancel's promise (its call and WAIT on the batch's master)."""
    import asyncio

    from shared import batch_ops
    from shared.redis_client import async_client
    from workers import upkeep

    streams = [names.stream(names.JOBS, p) for p in names.partitions()]
    for stream in streams:
        try:
            cluster.xgroup_create(stream, names.TOKENIZER_GROUP, id="0", mkstream=True)
        except redis.ResponseError:
            pass  # (made by an earlier test)
        cluster.xgroup_createconsumer(stream, names.TOKENIZER_GROUP, f"gone-{uuid.uuid4().hex[:6]}")
    assert upkeep.run(cluster, idle_ms=0).pruned >= len(streams)
    assert all(not cluster.xinfo_consumers(s, names.TOKENIZER_GROUP) for s in streams)

    batch_id = f"batch_{uuid.uuid4().hex}"
    cluster.hset(names.batch_key(batch_id), "status", "in_progress")

    async def cancel() -> None:
        node = cluster.get_default_node()  # type: ignore[attr-defined]
        password = node.redis_connection.connection_pool.connection_kwargs.get("password") or ""
        client = async_client(f"redis://:{password}@{node.host}:{node.port}/0")
        try:
            with pytest.raises(batch_ops.NotCopied):  # no replicas here: the cancel is made, and not promised
                await batch_ops.request_cancel(client, batch_id, 1.0)
        finally:
            await client.aclose()

    asyncio.run(cancel())
    assert cluster.hget(names.batch_key(batch_id), "status") == b"cancelling"
