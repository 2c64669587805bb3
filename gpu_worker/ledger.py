"""Which stream entries this worker holds and which of their jobs are still running.

A `tokenized` entry carries one job (or, from before the fair queue, several); it is acknowledged once
every one of them has a recorded end, so a worker that dies leaves each unfinished job claimable. The
ledger also bounds the jobs in flight, so the reader takes no more jobs than the engine can start soon.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection

from shared.redis_client import RETRYABLE
from shared.retry import call
from shared.stream_consumer import Ref, StreamConsumer

log = logging.getLogger("conveyor.inference")

ACK_ATTEMPTS = 20


class EntryLedger:
    def __init__(self, consumer: StreamConsumer, max_jobs: int, spare: int = 0) -> None:
        """`max_jobs`: jobs held at once (running or about to); `spare`: more, for jobs of tenants with none
        here, which the engine gives a slot at once (gpu_worker/engine/scheduler.py)."""
        self.consumer = consumer
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)
        self._entry_jobs: dict[Ref, set[str]] = {}
        self._job_entry: dict[str, Ref] = {}
        self._job_tenant: dict[str, str] = {}  # jobs holding a slot -> their fair-queue tenant
        self._max_jobs, self._spare, self._held = max_jobs, spare, 0

    def has_room(self, timeout: float) -> bool:
        """Whether a job could start now (waits up to `timeout` for one to end)."""
        with self._room:
            return self._room.wait_for(lambda: self._held < self._max_jobs, timeout)

    def free(self) -> int:
        """How many more jobs could be taken now."""
        with self._lock:
            return self._max_jobs - self._held

    def spare(self) -> int:
        """How many more jobs of tenants with none here could be taken now, beyond `free`."""
        with self._lock:
            return self._max_jobs + self._spare - self._held

    def tenants(self) -> set[str]:
        """The tenants of the jobs held here."""
        with self._lock:
            return set(self._job_tenant.values())

    def open(self, entry_id: Ref, job_ids: Collection[str]) -> None:
        with self._lock:
            self._entry_jobs[entry_id] = set(job_ids)
            for job_id in job_ids:
                self._job_entry[job_id] = entry_id

    def take_slot(self, job_id: str, tenant: str = "") -> None:
        """Before a job of an open entry goes to the engine; blocks while the spare room is full too."""
        with self._room:
            self._room.wait_for(lambda: self._held < self._max_jobs + self._spare)
            self._held += 1
            self._job_tenant[job_id] = tenant

    def close(self, job_id: str) -> None:
        """The job's end is recorded: free its slot, and acknowledge its entry if it was the last."""
        with self._lock:
            entry_id = self._job_entry.pop(job_id, None)
            jobs = self._entry_jobs.get(entry_id) if entry_id is not None else None
            if entry_id is None or jobs is None:
                return
            jobs.discard(job_id)
            complete = not jobs
            if complete:
                del self._entry_jobs[entry_id]
            if self._job_tenant.pop(job_id, None) is not None:
                self._held -= 1
                self._room.notify_all()
        if complete:
            try:
                call(lambda: self.consumer.ack([entry_id]), attempts=ACK_ATTEMPTS, log=log, name="ack")
            except RETRYABLE as exc:
                log.warning("entry %s not acknowledged (%s); it stays pending", entry_id, exc)

    def entries(self) -> list[Ref]:
        with self._lock:
            return list(self._entry_jobs)

    def idle(self) -> bool:
        """No job of any entry is running here."""
        with self._lock:
            return not self._job_entry

    def hand_back(self, idle_ms: int) -> None:
        """Make the entries still held claimable by other workers right away (they resume the jobs)."""
        refs = self.entries()
        if refs:
            self.consumer.hand_back(refs, idle_ms)
            log.info("handed back %d entries", len(refs))
