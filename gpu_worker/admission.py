"""Admission: each job of a `tokenized` entry is started, or resumed where another worker left it.

The output lane learns a job (its stop strings, where its stream stands) before the engine gets
it, so the lane knows every job whose tokens it receives.
"""

from __future__ import annotations

import logging
from multiprocessing.queues import Queue
from queue import SimpleQueue
from typing import Any

import pyarrow as pa

from gpu_worker.engine import Request
from gpu_worker.ledger import EntryLedger
from gpu_worker.messages import Add, EngineCommand, LaneCommand, Register
from gpu_worker.stats import WorkerStats
from shared.job_ops import JobOps, unpack_ids
from shared.schemas import TOKENIZED_SCHEMA, from_ipc
from shared.stream_consumer import Entry, StreamConsumer

log = logging.getLogger("conveyor.inference")

STARTED, RESUMED = 1, 2  # START_SCRIPT's codes for a job to run here


def entry_batch(entry: Entry) -> pa.RecordBatch:
    raw = entry.fields.get(b"batch", entry.fields.get("batch"))
    return from_ipc(raw if isinstance(raw, bytes) else str(raw).encode(), TOKENIZED_SCHEMA)


def request_of(row: dict[str, Any], resume_ids: list[int]) -> Request:
    return Request(id=row["job_id"], prompt_ids=row["prompt_ids"], max_tokens=row["max_tokens"],
                   temperature=row["temperature"], top_p=row["top_p"], top_k=row["top_k"], seed=row["seed"],
                   stop_token_ids=tuple(row["stop_token_ids"]), ignore_eos=row["ignore_eos"], resume_ids=resume_ids)


class Admission:
    def __init__(self, consumer: StreamConsumer, jobs: JobOps, ledger: EntryLedger, worker_id: str,
                 inbox: SimpleQueue[EngineCommand], to_lane: Queue[LaneCommand], stats: WorkerStats) -> None:
        self.consumer, self.jobs, self.ledger = consumer, jobs, ledger
        self.worker_id, self.inbox, self.to_lane, self.stats = worker_id, inbox, to_lane, stats

    def admit(self, entry: Entry) -> None:
        try:
            batch = entry_batch(entry)
        except Exception as exc:
            self.consumer.dead_letter(entry, f"unreadable batch: {exc}")
            return
        started: list[tuple[dict[str, Any], int, int, float]] = []
        for row in batch.to_pylist():
            code, seq, created = self.jobs.start(row["job_id"], self.worker_id)
            if code in (STARTED, RESUMED):
                started.append((row, code, seq, created))
        if not started:  # every job already ended (or was cancelled) elsewhere
            self.consumer.ack([entry.id])
            return
        self.ledger.open(entry.id, [row["job_id"] for row, _, _, _ in started])
        for row, code, seq, created in started:
            self.ledger.take_slot()
            resume_ids: list[int] = []
            emitted = ""
            if code == RESUMED:  # another worker began this job: continue from what it recorded
                resume_ids, emitted, seq = self.progress(row["job_id"])
                self.stats.jobs_resumed += 1
            self.stats.jobs_started += 1
            self.to_lane.put(Register(
                job_id=row["job_id"], stop=tuple(row["stop"]), created_at=created,
                prompt_tokens=len(row["prompt_ids"]), started=code == STARTED, seq=seq,
                resume_ids=tuple(resume_ids), emitted=emitted))
            self.inbox.put(Add(request_of(row, resume_ids)))

    def progress(self, job_id: str) -> tuple[list[int], str, int]:
        """What the job's earlier worker recorded: its token ids, their streamed text, the last event seq."""
        packed, text, seq = self.jobs.resume_state(job_id)
        return unpack_ids(packed), text, seq
