"""Admission of a `tokenized` entry (one job each), on a real Redis: a failure partway through (Redis gone while a
resumed job's progress is read) leaves nothing held, so the entry is admitted once Redis answers again."""

from __future__ import annotations

import queue
import time
from queue import SimpleQueue
from typing import Any

import pytest
import redis

from gpu_worker.admission import Admission
from gpu_worker.ledger import EntryLedger
from gpu_worker.messages import Add
from gpu_worker.stats import WorkerStats
from shared import names
from shared.job_ops import JobOps
from shared.schemas import Request, encode_request
from shared.stream_consumer import StreamConsumer

STREAM = names.stream(names.TOKENIZED, 0)


class RedisGoneOnResume(JobOps):
    """The job store as Redis leaves it mid-admission: the job was taken, then the connection drops."""

    def resume_state(self, job_id: str) -> tuple[bytes, str, int, int]:
        raise redis.ConnectionError("Connection refused")


def _entries(r: redis.Redis) -> Any:
    """Two entries as fair_pop.lua hands them out, one job each: a fresh job, and one begun elsewhere."""
    now = repr(time.time())
    for job_id in ("job_fresh", "job_resumed"):
        r.hset(names.job_key(job_id), mapping={"id": job_id, "status": "queued", "model": "tiny", "created_at": now,
                                                "seq": 0})
        r.xadd(STREAM, {"batch": encode_request(Request(job_id, [5, 6, 7], max_tokens=4, temperature=0.7)),
                        "jobs": 1})
    assert JobOps(r, 60).start("job_resumed", "worker-that-died").code.name == "started"  # begun elsewhere
    consumer = StreamConsumer(r, STREAM, names.INFERENCE_GROUP, "worker-here", names.INFERENCE_POOL)
    consumer.ensure_group()
    return consumer, consumer.read(2, 100)


def test_a_failure_partway_through_an_entry_holds_nothing_and_the_entry_comes_in_later(
        bytes_db: redis.Redis, redis_db: redis.Redis) -> None:
    consumer, [fresh, resumed] = _entries(bytes_db)
    ledger = EntryLedger(consumer, max_jobs=4)
    inbox: SimpleQueue[Any] = SimpleQueue()
    to_lane: queue.Queue[Any] = queue.Queue()

    def admission(jobs: JobOps) -> Admission:
        return Admission(consumer, jobs, ledger, "worker-here", inbox, to_lane, WorkerStats())  # type: ignore[arg-type]

    with pytest.raises(redis.ConnectionError):
        admission(RedisGoneOnResume(bytes_db, 60)).admit(resumed)
    assert ledger.entries() == [] and ledger.free() == 4  # the job is not held, no slot taken
    assert inbox.empty() and to_lane.empty()  # and nothing reached the engine or the output lane

    admission(JobOps(bytes_db, 60)).admit(resumed)  # Redis answers again: the reader admits it again
    admission(JobOps(bytes_db, 60)).admit(fresh)
    assert sorted(ledger.entries()) == sorted([fresh.ref, resumed.ref]) and ledger.free() == 2
    added = [inbox.get_nowait() for _ in range(2)]
    assert all(isinstance(a, Add) for a in added) and [a.request.id for a in added] == ["job_resumed", "job_fresh"]
    assert added[0].request == Request("job_resumed", [5, 6, 7], max_tokens=4, temperature=0.7,
                                       tenant=added[0].request.tenant)  # the record as the tokenizer wrote it


def test_a_job_whose_cancel_was_asked_while_its_worker_died_ends_cancelled_on_redelivery(
        bytes_db: redis.Redis, redis_db: redis.Redis) -> None:
    """The API asked the engine running the job to stop it (request_cancel.lua: cancel_requested), and that worker
    died before it did: the worker the entry is redelivered to runs nothing, ends the job cancelled and
    acknowledges its entry, rather than leaving it running for ever."""
    consumer, entries = _entries(bytes_db)
    bytes_db.hset(names.job_key("job_resumed"), "cancel_requested", "1")
    ledger = EntryLedger(consumer, max_jobs=4)
    inbox: SimpleQueue[Any] = SimpleQueue()
    admission = Admission(consumer, JobOps(bytes_db, 60), ledger, "worker-here", inbox,  # type: ignore[arg-type]
                          queue.Queue(), WorkerStats())
    for entry in entries:
        admission.admit(entry)
    assert redis_db.hget(names.job_key("job_resumed"), "status") == "cancelled"
    assert redis_db.hget(names.job_key("job_resumed"), "finish_reason") == "cancelled"
    adds = [cmd.request.id for cmd in _drain(inbox) if isinstance(cmd, Add)]
    assert adds == ["job_fresh"]  # only the other job runs here
    assert ledger.entries() == [entries[0].ref]
    assert bytes_db.xpending(STREAM, names.INFERENCE_GROUP)["pending"] == 1  # the cancelled job's entry is acked


def test_an_unreadable_entry_goes_to_the_dead_letters_alone(bytes_db: redis.Redis, redis_db: redis.Redis) -> None:
    consumer, entries = _entries(bytes_db)
    bytes_db.xadd(STREAM, {"batch": b"not arrow", "jobs": 1})
    [bad] = consumer.read(1, 100)
    ledger = EntryLedger(consumer, max_jobs=4)
    inbox: SimpleQueue[Any] = SimpleQueue()
    admission = Admission(consumer, JobOps(bytes_db, 60), ledger, "worker-here", inbox,  # type: ignore[arg-type]
                          queue.Queue(), WorkerStats())
    admission.admit(bad)
    admission.admit(entries[0])
    [dead] = redis_db.xrange(names.stream(names.DEAD, 0))
    assert "unreadable tokenized record" in dead[1]["reason"]
    assert [cmd.request.id for cmd in _drain(inbox) if isinstance(cmd, Add)] == ["job_fresh"]


def _drain(q: SimpleQueue[Any]) -> list[Any]:
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


def test_a_job_handed_out_again_while_it_runs_here_is_not_started_again(bytes_db: redis.Redis,
                                                                        redis_db: redis.Redis) -> None:
    """A failover can hand a job out twice: a master that answered the fair queue's pop (or the job's start) and died
    before its replica had it leaves the job queued on the promoted replica, and the worker running it may pop it
    again. The second entry joins the first: nothing is started, registered with the output lane or added to the
    engine again, no second slot is taken, and both entries are acknowledged with the job's end. Before, the
    second admission registered the job with the lane afresh, from a record that lacked the steps lost with the
    master, while the engine ran on: a succeeded job with a hole in its text."""
    consumer, [fresh, _] = _entries(bytes_db)
    ledger = EntryLedger(consumer, max_jobs=4)
    inbox: SimpleQueue[Any] = SimpleQueue()
    to_lane: queue.Queue[Any] = queue.Queue()
    admission = Admission(consumer, JobOps(bytes_db, 60), ledger, "worker-here", inbox,  # type: ignore[arg-type]
                          to_lane, WorkerStats())
    admission.admit(fresh)
    bytes_db.xadd(STREAM, {"batch": encode_request(Request("job_fresh", [5, 6, 7], max_tokens=4, temperature=0.7)),
                           "jobs": 1})
    [again] = consumer.read(1, 100)
    admission.admit(again)
    assert [cmd.request.id for cmd in _drain(inbox) if isinstance(cmd, Add)] == ["job_fresh"]  # once
    assert to_lane.qsize() == 1  # one Register
    assert ledger.free() == 3 and sorted(ledger.entries()) == sorted([fresh.ref, again.ref])
    pending = bytes_db.xpending(STREAM, names.INFERENCE_GROUP)["pending"]
    ledger.close("job_fresh")
    assert bytes_db.xpending(STREAM, names.INFERENCE_GROUP)["pending"] == pending - 2
    assert ledger.free() == 4 and ledger.entries() == []
