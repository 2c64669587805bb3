"""A cluster master that stops answering holds back only its own partitions' jobs: a tokenizer's read, an inference
worker's pop and their upkeep, each over every partition, take and keep the other masters' jobs meanwhile.

- Paused (its connections stay open, nothing comes back), on a cluster whose node timeout outlasts the test (no
  failover): the silent master's jobs come once it answers again. Before, each call waited on the silent node (10 s
  a try, tried again) for every partition.
- Dead with no replica to take over (for good): the other masters' jobs go on being read and taken once the cluster
  has marked it failed (the cluster serves the slots it can: `cluster-require-full-coverage no`). Before, every
  call failed for good: the dead node's connection, then CLUSTERDOWN from every node.
- Silent between a read (or a pop) and its jobs' queueing (or start): the other master's job goes on at once, the
  silent one's is held until its master answers. So with what a job needs beyond its own keys (its grammar, its
  adapter's registry) and with its end's acknowledgement.
"""

from __future__ import annotations

import json
import queue
import signal
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from queue import SimpleQueue
from typing import Any, TypeVar

import pytest

from gpu_worker.admission import Admission, entry_request
from gpu_worker.ledger import EntryLedger
from gpu_worker.reader import Reader
from gpu_worker.stats import WorkerStats
from infra.redis_cluster import LocalCluster
from shared import fair_queue, names
from shared.fair_queue import FairQueue
from shared.job_ops import JobOps
from shared.jobs import new_record
from shared.lora import LoraModule
from shared.masters import FAST_TIMEOUT_S, fail_fast
from shared.redis_client import sync_client
from shared.schemas import GenerationRequest, Grammar, Request, encode_request
from shared.settings import Settings
from shared.stream_consumer import StreamConsumer
from tests.helpers import master_of, partitions_elsewhere, until
from workers.tokenizer.worker import TokenizerWorker

T = TypeVar("T")
# a call that meets the silent master waits for its client's timeout once; the old calls waited 10 s a try
ANSWERED_S = FAST_TIMEOUT_S + 4.0
AGAIN_S = 10.0  # how long a master that answers again may take to be read again (its probe: 0.25 s)
CLAIM_IDLE_MS = 2_000  # the claim deadline of the claim test's consumer
HELD = 16  # a batch's jobs of the silent master: one wait for all (a cluster pipeline waited once for each)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster(tmp_path_factory.mktemp("silent-master"), masters=3, replicas=0, appendfsync="no",
                           node_timeout_ms=120_000)
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def twelve() -> Iterator[None]:
    with names.partitions_as(12):  # a 3-master cluster's (`conveyor up --redis-cluster 3`)
        yield


def _answered(call: Callable[[], T]) -> T:
    """The call's answer, which must come while the master stays silent."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(call).result(timeout=ANSWERED_S)


def _reader(r: Any, fast: Any, model: str, worker: str) -> tuple[StreamConsumer, EntryLedger, SimpleQueue[Any],
                                                                 Reader]:
    """An inference worker's reader lane for `model`'s queue on every partition, starting jobs on the fail-fast
    client (as the worker does): its consumer, ledger, the engine's inbox and the reader."""
    consumer = StreamConsumer(r, [names.stream(names.TOKENIZED, q, model) for q in names.partitions()],
                              names.INFERENCE_GROUP, worker, names.inference_pool(model), fast=fast)
    consumer.ensure_group()
    ledger = EntryLedger(consumer, max_jobs=8)
    inbox: SimpleQueue[Any] = SimpleQueue()
    jobs = JobOps(r, 60, model)
    admission = Admission(consumer, jobs, ledger, worker, inbox, queue.Queue(), WorkerStats(),  # type: ignore[arg-type]
                          starts=JobOps(fast, 60, model))
    return consumer, ledger, inbox, Reader(r, consumer, jobs, ledger, admission, 60.0, threading.Event())


@pytest.mark.usefixtures("twelve")
def test_a_silent_master_holds_back_only_its_own_partitions_jobs(nodes: LocalCluster) -> None:
    r = sync_client(nodes.seed_url, decode=False)
    fast = fail_fast(nodes.seed_url)
    assert fast is not None
    model = "silent"
    silent, other = master_of(r, 0), partitions_elsewhere(r, 0)[0]
    for q in names.partitions():
        r.xgroup_create(names.stream(names.TOKENIZED, q, model), names.INFERENCE_GROUP, id="0", mkstream=True)
    streams = [names.stream(names.JOBS, q, model) for q in names.partitions()]
    consumer = StreamConsumer(r, streams, "silent-tokenizers", "tok-s", names.TOKENIZER_POOL, fast=fast)
    consumer.ensure_group()
    # an inference worker's: its pops go master by master as its consumer's reads do
    worker = StreamConsumer(r, [names.stream(names.TOKENIZED, q, model) for q in names.partitions()],
                            names.INFERENCE_GROUP, "w-silent", names.inference_pool(model),
                            fast=fail_fast(nodes.seed_url))
    queue = FairQueue(r, "w-silent", model, worker.masters)
    held, free = names.job_id_in(0, uuid.uuid4().hex), names.job_id_in(other, uuid.uuid4().hex)
    # one entry of each partition already read (running: kept fresh by the upkeep)
    running = []
    for job_id in (held, free):
        stream = names.stream(names.JOBS, names.job_partition(job_id), model)
        r.xadd(stream, {"job_id": b"running-" + job_id.encode()})
        running += [e.ref for e in consumer.read(10, block_ms=None)]
    assert len(running) == 2
    for job_id in (held, free):
        r.xadd(names.stream(names.JOBS, names.job_partition(job_id), model), {"job_id": job_id})
        r.hset(names.job_key(job_id), mapping={"status": "queued"})
        assert fair_queue.push(r, names.job_partition(job_id), [], [(job_id, 0, 10, job_id.encode())], model=model)
    nodes.kill(silent.port, signal.SIGSTOP)
    try:
        assert [e.fields[b"job_id"] for e in _answered(lambda: consumer.read(10, block_ms=None))] == [free.encode()]
        assert [e.fields[b"batch"] for e in _answered(lambda: queue.pop(4, None))] == [free.encode()]
        # the upkeep answers too: the other partition's entries are kept fresh and looked over
        _answered(lambda: consumer.refresh(running))
        assert _answered(lambda: consumer.retry_own(60_000)) == ([], [])
        assert _answered(lambda: consumer.claim_stale()) == ([], [])
        # a read that blocks turns the other partitions over (nothing new there) and answers in its block time
        assert _answered(lambda: consumer.read(10, block_ms=300)) == []
        assert _answered(lambda: queue.pop(4, block_ms=300)) == []
    finally:
        nodes.kill(silent.port, signal.SIGCONT)
    # once it answers (its probe finds it so), its jobs come: read, or read back from this
    # consumer's history where a read that timed out ran all the same once the master went on
    running_refs = set(running)
    got: list[bytes] = []
    until("the silent master's job read",
          lambda: got.extend(e.fields[b"job_id"] for e in consumer.lost() + consumer.read(10, None)
                             if e.ref not in running_refs) or got, AGAIN_S)
    assert got == [held.encode()]
    popped: list[bytes] = []
    until("the silent master's job popped",
          lambda: popped.extend(e.fields[b"batch"] for e in worker.lost() + queue.pop(4, None)) or popped, AGAIN_S)
    assert popped == [held.encode()]
    # reading back what a lost reply took counted no delivery more of the entries it did not take
    for stream, eid in running:
        assert r.xpending_range(stream, "silent-tokenizers", eid, eid, 1)[0]["times_delivered"] == 1
    worker.ring.close()
    consumer.ring.close()
    queue.ring.close()
    fast.close()
    r.close()


@pytest.mark.usefixtures("twelve")
def test_a_tokenizer_queues_a_reads_jobs_though_one_master_goes_silent_mid_batch(nodes: LocalCluster,
                                                                               model_path: str) -> None:
    """The read took jobs of two masters' partitions; one master goes silent before they are queued: the other's
    job is queued at once, the silent one's (many: each is not waited on again) held, and queued once its master
    answers again."""
    settings = Settings(redis_url=nodes.seed_url, model=model_path, max_model_len=1024)
    w = TokenizerWorker(settings)
    r = sync_client(nodes.seed_url)
    w.consumer.ensure_group()
    silent, other = master_of(r, 1), partitions_elsewhere(r, 1)[0]
    held = [names.job_id_in(1, uuid.uuid4().hex) for _ in range(HELD)]
    free = names.job_id_in(other, uuid.uuid4().hex)
    for job_id in [*held, free]:
        request = json.dumps({"prompt": "Hello there", "max_tokens": 4})
        r.hset(names.job_key(job_id), mapping={k: v for k, v in new_record(job_id, "m", request).items()
                                               if k != "request"})
        r.xadd(names.stream(names.JOBS, names.job_partition(job_id)), {"job_id": job_id, "request": request})
    entries = w.consumer.read(64, block_ms=None)
    assert {e.fields[b"job_id"] for e in entries} == {j.encode() for j in [*held, free]}

    def queued(job_id: str) -> bool:
        return r.hexists(names.fair_key(names.job_partition(job_id), "payload"), job_id)

    nodes.kill(silent.port, signal.SIGSTOP)
    try:
        _answered(lambda: w.process(entries))
        assert queued(free)
        assert sorted(e.fields[b"job_id"] for e in w.held.values()) == sorted(j.encode() for j in held)
    finally:
        nodes.kill(silent.port, signal.SIGCONT)
    until("the held jobs queued", lambda: w.step() or all(queued(j) for j in held), AGAIN_S)
    assert not w.held and r.xpending(names.stream(names.JOBS, 1), names.TOKENIZER_GROUP)["pending"] == 0
    w.consumer.ring.close()
    r.close()


@pytest.mark.usefixtures("twelve")
def test_an_inference_worker_starts_a_pops_jobs_though_one_master_goes_silent_mid_batch(nodes: LocalCluster) -> None:
    """The pop took jobs of two masters' partitions; one master goes silent before they are started: the other's
    job is started and reaches the engine at once, the silent one's is held, and started once its master answers."""
    model = "admitted"
    r, fast = sync_client(nodes.seed_url, decode=False), fail_fast(nodes.seed_url)
    assert fast is not None
    silent, other = master_of(r, 2), partitions_elsewhere(r, 2)[0]
    consumer, ledger, inbox, reader = _reader(r, fast, model, "w-admit")
    held, free = names.job_id_in(2, uuid.uuid4().hex), names.job_id_in(other, uuid.uuid4().hex)
    for job_id in (held, free):
        r.hset(names.job_key(job_id), mapping=new_record(job_id, "m", "{}"))
        row = encode_request(Request(job_id, [5, 6, 7], max_tokens=4))
        assert fair_queue.push(r, names.job_partition(job_id), [], [(job_id, 0, 3, row)], model=model)
    entries = reader.queue.pop(8, None)
    assert {entry_request(e).id for e in entries} == {held, free}
    nodes.kill(silent.port, signal.SIGSTOP)
    try:
        _answered(lambda: [reader._admit(e) for e in entries])
        assert [inbox.get_nowait().request.id] == [free] and inbox.empty()
        assert [entry_request(e).id for e in reader.held.values()] == [held]
    finally:
        nodes.kill(silent.port, signal.SIGCONT)
    until("the held job started", lambda: reader.step() or not inbox.empty(), AGAIN_S)
    assert inbox.get_nowait().request.id == held and not reader.held
    assert sorted(ledger.entries()) == sorted(e.ref for e in entries)
    consumer.ring.close()
    reader.queue.ring.close()
    fast.close()
    r.close()


@pytest.mark.usefixtures("twelve")
def test_a_claim_answers_at_once_while_the_pools_registry_master_is_silent(nodes: LocalCluster) -> None:
    """An entry of a consumer that is gone, on another master than the pools' registry's: while the registry's
    master is silent, a claim cannot tell who is alive and claims nothing, in its client's timeout; once the
    master answers, nothing is claimed until the pool's live workers had the claim deadline to be heard again
    (their heartbeats were held back too), then the entry is."""
    r, fast = sync_client(nodes.seed_url, decode=False), fail_fast(nodes.seed_url)
    assert fast is not None
    pool = "claimers"
    silent = r.get_node_from_key(names.workers_key(pool))
    partition = next(p for p in names.partitions() if master_of(r, p).name != silent.name)
    stream = names.stream(names.JOBS, partition, "claims")
    consumer = StreamConsumer(r, [stream], "claimers", "alive", pool, claim_idle_ms=CLAIM_IDLE_MS, fast=fast)
    consumer.ensure_group()
    entry_id = r.xadd(stream, {"job_id": b"left-behind"})
    r.xreadgroup("claimers", "gone", {stream: ">"})  # read by a consumer that is not in the registry
    until("the entry idle", lambda: r.xpending_range(stream, "claimers", "-", "+", 1, idle=CLAIM_IDLE_MS), 5.0)
    nodes.kill(silent.port, signal.SIGSTOP)
    try:
        assert _answered(consumer.claim_stale) == ([], [])
    finally:
        nodes.kill(silent.port, signal.SIGCONT)
    until("the registry's master answering", lambda: not consumer.masters.is_down(names.workers_key(pool)), AGAIN_S)
    assert consumer.claim_stale() == ([], [])
    claimed: list[Any] = []
    until("the entry claimed", lambda: claimed.extend(consumer.claim_stale()[0]) or claimed, AGAIN_S)
    assert [e.id for e in claimed] == [entry_id.decode()]
    consumer.ring.close()
    fast.close()
    r.close()


@pytest.mark.usefixtures("twelve")
def test_the_upkeep_trims_every_other_masters_streams_while_one_is_silent(nodes: LocalCluster) -> None:
    """Stream trimming (the Celery app's upkeep, on its fail-fast client): a silent master costs it one short wait,
    and only its own partitions' streams wait for the next run. Before, the first of them ended the run, and no
    stream after it in any partition was trimmed while the master stayed down."""
    from workers import upkeep

    r, fast = sync_client(nodes.seed_url, decode=False), fail_fast(nodes.seed_url)
    assert fast is not None
    streams = [names.stream(names.TOKENIZED, p) for p in names.partitions()]
    for stream in streams:  # five entries each, read and acknowledged: consumed, as the workers leave them
        r.xgroup_create(stream, names.INFERENCE_GROUP, id="0", mkstream=True)
        for i in range(5):
            r.xadd(stream, {"n": i})
        [(_, got)] = r.xreadgroup(names.INFERENCE_GROUP, "w", {stream: ">"})
        r.xack(stream, names.INFERENCE_GROUP, *[eid for eid, _ in got])
    silent = master_of(r, 0)
    held = {p for p in names.partitions() if master_of(r, p).name == silent.name}
    nodes.kill(silent.port, signal.SIGSTOP)
    try:
        done = _answered(lambda: upkeep.run(fast))
        assert done.missed == held
        assert {names.stream_partition(s): n for s, n in done.trimmed.items() if s in streams} == {
            p: 5 for p in names.partitions() if p not in held}
    finally:
        nodes.kill(silent.port, signal.SIGCONT)
    assert {p: r.xlen(names.stream(names.TOKENIZED, p)) for p in names.partitions()} == {
        p: 5 if p in held else 0 for p in names.partitions()}
    until("the silent master's streams trimmed once it answers", lambda: not upkeep.run(fast).missed, AGAIN_S)
    assert all(r.xlen(stream) == 0 for stream in streams)
    fast.close()
    r.close()


@pytest.mark.usefixtures("twelve")
def test_a_job_with_a_grammar_is_queued_while_every_other_master_is_silent(nodes: LocalCluster,
                                                                         model_path: str) -> None:
    """A job's compiled grammar is kept in its partition's slot: while every master but its partition's is
    silent, the job is tokenized, its grammar compiled and stored, and queued, in one client timeout per master
    met. (A grammar kept under one key for every partition sat on one master: every partition's structured jobs
    waited on it, 10 s a try, and then failed.)"""
    settings = Settings(redis_url=nodes.seed_url, model=model_path, max_model_len=1024)
    w = TokenizerWorker(settings)
    r = sync_client(nodes.seed_url)
    w.consumer.ensure_group()
    request = GenerationRequest(prompt="Hello there", max_tokens=4, grammar=Grammar(kind="regex", source="[0-9]+"))
    spec = request.grammar
    assert spec is not None
    shared_key = r.get_node_from_key(f"{names.PREFIX}:grammar:{spec.spec.key}")  # (where one key for all sat)
    p = next(q for q in names.partitions() if master_of(r, q).name != shared_key.name)
    own = master_of(r, p)
    others = [n for n in r.get_primaries() if n.name != own.name]
    job_id = names.job_id_in(p, uuid.uuid4().hex)
    body = request.model_dump_json()
    r.hset(names.job_key(job_id), mapping={k: v for k, v in new_record(job_id, "m", body).items() if k != "request"})
    r.xadd(names.stream(names.JOBS, p), {"job_id": job_id, "request": body})
    # the compiler's child started and ready (seconds on a busy machine), with another grammar: what is timed below
    # is this job's own compile and store
    w._grammars(w.models[""]).prepare(Grammar(kind="regex", source="[a-z]+").spec, p)
    for node in others:
        nodes.kill(node.port, signal.SIGSTOP)
    try:
        entries = _answered(lambda: w.consumer.read(64, block_ms=None))
        assert [e.fields[b"job_id"] for e in entries] == [job_id.encode()]
        _answered(lambda: w.process(entries))
        assert r.hexists(names.fair_key(p, "payload"), job_id), r.hget(names.job_key(job_id), "error")
        assert r.exists(names.grammar_key(spec.spec.key, "", p))
    finally:
        for node in others:
            nodes.kill(node.port, signal.SIGCONT)
    w.consumer.ring.close()
    for m in w.models.values():
        if m.compiler is not None:
            m.compiler.close()
    r.close()


@pytest.mark.usefixtures("twelve")
def test_a_lora_job_waits_for_the_adapter_registrys_master_and_only_that(nodes: LocalCluster, tmp_path: Path) -> None:
    """A job on an adapter loaded at run time reads it from the registry at its admission: while the registry's
    master is silent, the job is held without a start (its own master is not passed over: the other jobs of its
    partition go on), and admitted once the registry's master answers."""
    model = "adapted"
    r, fast = sync_client(nodes.seed_url, decode=False), fail_fast(nodes.seed_url)
    assert fast is not None
    registry = r.get_node_from_key(names.LORAS)
    p = next(q for q in names.partitions() if master_of(r, q).name != registry.name)
    consumer, ledger, inbox, reader = _reader(r, fast, model, "w-lora")
    (tmp_path / "adapter_config.json").write_text("{}")  # (admission looks for it; the engine reads the files)
    r.hset(names.LORAS, "sql-adapter", LoraModule("sql-adapter", str(tmp_path)).to_json())
    adapted, plain = names.job_id_in(p, uuid.uuid4().hex), names.job_id_in(p, uuid.uuid4().hex)
    for job_id, lora in ((adapted, "sql-adapter"), (plain, "")):
        r.hset(names.job_key(job_id), mapping=new_record(job_id, "m", "{}"))
        row = encode_request(Request(job_id, [5, 6, 7], max_tokens=4, lora=lora))
        assert fair_queue.push(r, p, [], [(job_id, 0, 3, row)], model=model)
    entries = reader.queue.pop(8, None)
    assert {entry_request(e).id for e in entries} == {adapted, plain}
    nodes.kill(registry.port, signal.SIGSTOP)
    try:
        _answered(lambda: [reader._admit(e) for e in entries])
        assert [inbox.get_nowait().request.id] == [plain] and inbox.empty()
        assert [entry_request(e).id for e in reader.held.values()] == [adapted]
        assert not consumer.masters.is_down(names.stream(names.TOKENIZED, p, model))
        _answered(reader.step)  # held: not started again while the registry's master is silent
        assert inbox.empty()
    finally:
        nodes.kill(registry.port, signal.SIGCONT)
    until("the held job admitted", lambda: reader.step() or not inbox.empty(), AGAIN_S)
    added = inbox.get_nowait().request
    assert added.id == adapted and added.lora_path == str(tmp_path) and not reader.held
    r.hdel(names.LORAS, "sql-adapter")
    consumer.ring.close()
    reader.queue.ring.close()
    fast.close()
    r.close()


@pytest.mark.usefixtures("twelve")
def test_a_jobs_end_is_acknowledged_master_by_master(nodes: LocalCluster) -> None:
    """Two jobs end together, one on a master that has gone silent: the other's entry is acknowledged at once, the
    silent one's is left pending (taken back later by the worker's own retry) without holding the worker's
    reports behind it."""
    model = "acked"
    r, fast = sync_client(nodes.seed_url, decode=False), fail_fast(nodes.seed_url)
    assert fast is not None
    silent, other = master_of(r, 3), partitions_elsewhere(r, 3)[0]
    consumer = StreamConsumer(r, [names.stream(names.TOKENIZED, q, model) for q in names.partitions()],
                              names.INFERENCE_GROUP, "w-ack", names.inference_pool(model), fast=fast)
    consumer.ensure_group()
    ledger = EntryLedger(consumer, max_jobs=8)
    refs, jobs = {}, {}
    for p in (3, other):
        stream = names.stream(names.TOKENIZED, p, model)
        r.xadd(stream, {"batch": b"x"})
        [(_, [(eid, _)])] = r.xreadgroup(names.INFERENCE_GROUP, "w-ack", {stream: ">"})
        jobs[p], refs[p] = names.job_id_in(p, uuid.uuid4().hex), (stream, eid.decode())
        ledger.open(refs[p], jobs[p])
        ledger.take_slot(jobs[p], "t", 0)
    nodes.kill(silent.port, signal.SIGSTOP)
    try:
        _answered(lambda: [ledger.close(jobs[p]) for p in (3, other)])
    finally:
        nodes.kill(silent.port, signal.SIGCONT)
    assert r.xpending(refs[other][0], names.INFERENCE_GROUP)["pending"] == 0
    assert r.xpending(refs[3][0], names.INFERENCE_GROUP)["pending"] == 1
    assert not ledger.entries()
    consumer.ring.close()
    fast.close()
    r.close()


@pytest.mark.usefixtures("twelve")
def test_a_dead_master_with_no_replica_holds_back_only_its_own_partitions_jobs(tmp_path: Path) -> None:
    nodes = LocalCluster(tmp_path, masters=3, replicas=0, appendfsync="no", node_timeout_ms=1000)
    nodes.start()
    r, fast = sync_client(nodes.seed_url, decode=False), fail_fast(nodes.seed_url)
    try:
        model, stream = "dead", lambda p: names.stream(names.JOBS, p, "dead")
        dead, live = master_of(r, 0), partitions_elsewhere(r, 0)
        for q in names.partitions():
            r.xgroup_create(names.stream(names.TOKENIZED, q, model), names.INFERENCE_GROUP, id="0", mkstream=True)
        consumer = StreamConsumer(r, [stream(q) for q in names.partitions()], "dead-tokenizers", "tok-d",
                                  names.TOKENIZER_POOL, fast=fast)
        consumer.ensure_group()
        queue = FairQueue(r, "w-dead", model, consumer.masters)
        nodes.kill(dead.port)
        until("the dead master marked failed", lambda: any(
            e.port == dead.port and "fail" in e.flags for e in nodes._view()), 30, every=0.1)
        jobs = [names.job_id_in(p, uuid.uuid4().hex) for p in live[:3]]
        for job_id in jobs:  # submitted after it died, to the partitions of the masters alive
            p = names.job_partition(job_id)
            r.xadd(stream(p), {"job_id": job_id})
            r.hset(names.job_key(job_id), mapping={"status": "queued"})
            assert fair_queue.push(r, p, [], [(job_id, 0, 10, job_id.encode())], model=model)
        read: list[bytes] = []
        until("the live masters' jobs read", lambda: read.extend(
            e.fields[b"job_id"] for e in _answered(lambda: consumer.read(10, block_ms=300))) or len(read) >= 3, 10)
        popped: list[bytes] = []
        until("the live masters' jobs popped", lambda: popped.extend(
            e.fields[b"batch"] for e in _answered(lambda: queue.pop(4, block_ms=300))) or len(popped) >= 3, 10)
        assert sorted(read) == sorted(popped) == sorted(j.encode() for j in jobs)
        assert _answered(lambda: consumer.claim_stale()) == ([], [])
        consumer.ring.close()
        queue.ring.close()
    finally:
        r.close()
        if fast is not None:
            fast.close()
        nodes.stop()
