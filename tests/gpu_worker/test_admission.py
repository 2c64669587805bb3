"""Admission of a `tokenized` entry, on a real Redis: a failure partway through (Redis gone while a resumed job's
progress is read) leaves nothing held, so the entry is admitted whole once Redis answers again."""

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
from shared.schemas import Request, requests_batch, to_ipc
from shared.stream_consumer import StreamConsumer

STREAM = names.stream(names.TOKENIZED, 0)


class RedisGoneOnResume(JobOps):
    """The job store as Redis leaves it mid-admission: jobs were taken, then the connection drops."""

    def resume_state(self, job_id: str) -> tuple[bytes, str, int, int]:
        raise redis.ConnectionError("Connection refused")


def _entry(r: redis.Redis) -> Any:
    now = repr(time.time())
    for job_id in ("job_fresh", "job_resumed"):
        r.hset(names.job_key(job_id), mapping={"id": job_id, "status": "queued", "model": "tiny", "created_at": now,
                                                "seq": 0})
    assert JobOps(r, 60).start("job_resumed", "worker-that-died").code.name == "started"  # begun elsewhere
    batch = requests_batch([Request(j, [5, 6, 7], max_tokens=4) for j in ("job_fresh", "job_resumed")])
    r.xadd(STREAM, {"batch": to_ipc(batch), "jobs": 2})
    consumer = StreamConsumer(r, STREAM, names.INFERENCE_GROUP, "worker-here", names.INFERENCE_POOL)
    consumer.ensure_group()
    [entry] = consumer.read(1, 100)
    return consumer, entry


def test_a_failure_partway_through_an_entry_holds_nothing_and_the_entry_comes_in_whole_later(
        bytes_db: redis.Redis, redis_db: redis.Redis) -> None:
    consumer, entry = _entry(bytes_db)
    ledger = EntryLedger(consumer, max_jobs=4)
    inbox: SimpleQueue[Any] = SimpleQueue()
    to_lane: queue.Queue[Any] = queue.Queue()

    def admission(jobs: JobOps) -> Admission:
        return Admission(consumer, jobs, ledger, "worker-here", inbox, to_lane, WorkerStats())  # type: ignore[arg-type]

    with pytest.raises(redis.ConnectionError):
        admission(RedisGoneOnResume(bytes_db, 60)).admit(entry)
    assert ledger.entries() == [] and ledger.free() == 4  # no job of it is held, no slot taken
    assert inbox.empty() and to_lane.empty()  # and nothing reached the engine or the output lane

    admission(JobOps(bytes_db, 60)).admit(entry)  # Redis answers again: the reader admits it again (readmit_forgotten)
    assert ledger.entries() == [entry.ref] and ledger.free() == 2
    added = [inbox.get_nowait() for _ in range(2)]
    assert all(isinstance(a, Add) for a in added) and {a.request.id for a in added} == {"job_fresh", "job_resumed"}


def test_a_job_whose_cancel_was_asked_while_its_worker_died_ends_cancelled_on_redelivery(
        bytes_db: redis.Redis, redis_db: redis.Redis) -> None:
    """The API asked the engine running the job to stop it (request_cancel.lua: cancel_requested), and that worker
    died before it did: the worker the entry is redelivered to runs nothing and ends the job cancelled, rather
    than leaving it running for ever."""
    consumer, entry = _entry(bytes_db)
    bytes_db.hset(names.job_key("job_resumed"), "cancel_requested", "1")
    ledger = EntryLedger(consumer, max_jobs=4)
    inbox: SimpleQueue[Any] = SimpleQueue()
    Admission(consumer, JobOps(bytes_db, 60), ledger, "worker-here", inbox, queue.Queue(),  # type: ignore[arg-type]
              WorkerStats()).admit(entry)
    assert redis_db.hget(names.job_key("job_resumed"), "status") == "cancelled"
    assert redis_db.hget(names.job_key("job_resumed"), "finish_reason") == "cancelled"
    adds = [cmd.request.id for cmd in _drain(inbox) if isinstance(cmd, Add)]
    assert adds == ["job_fresh"]  # only the other job runs here


def _drain(q: SimpleQueue[Any]) -> list[Any]:
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out
