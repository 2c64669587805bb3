"""Which stream entries this worker holds, each for the one job it carries.

A `tokenized` entry carries one job (fair_pop.lua hands out one per entry); it is acknowledged once the
job has a recorded end, so a worker that dies leaves each unfinished job claimable. The
ledger also bounds the jobs in flight, so the reader takes no more jobs than the engine can start soon, and
knows each one's tenant and priority: with every slot taken, the reader still takes a job the engine would
make room for (gpu_worker/reader.py).

A failover can hand a job out twice (a master that answered the fair queue's pop, or the job's start, died before
its replica had it: the promoted replica still has the job queued), and the worker running it may pop it again: the
second entry joins the first (`join`), and both are acknowledged with the job's end.

A job the output lane drops (its record is gone, or another worker runs it now) is forgotten: its entry is
never acknowledged here. XACK by the group takes an entry out of the pending list whoever holds it, so
acknowledging an entry another worker claimed would strip that worker's redelivery guarantee. An entry
still this worker's stays pending, no longer refreshed, until `Reader.readmit_forgotten` admits it again
and start.lua says what is left to run (then it is acknowledged like any).
"""

from __future__ import annotations

import logging
import threading

from shared.redis_client import RETRYABLE
from shared.retry import call
from shared.stream_consumer import Ref, StreamConsumer

log = logging.getLogger("conveyor.inference")

ACK_ATTEMPTS = 20


class EntryLedger:
    def __init__(self, consumer: StreamConsumer, max_jobs: int, spare: int = 0) -> None:
        """`max_jobs`: jobs held at once (running or about to); `spare`: more, for jobs the engine gives a slot
        at once (gpu_worker/engine/scheduler.py): of a tenant with none here, or of a better priority than one
        its tenant runs here."""
        self.consumer = consumer
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)
        self._job_entry: dict[str, list[Ref]] = {}  # jobs of open entries -> their entries (one, but for `join`)
        self._job_class: dict[str, tuple[str, int]] = {}  # jobs holding a slot -> (fair-queue tenant, priority)
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
        """How many more jobs the engine would make room for could be taken now, beyond `free`."""
        with self._lock:
            return self._max_jobs + self._spare - self._held

    def worst_priorities(self) -> dict[str, int]:
        """The tenants of the jobs held here, each with the worst (highest) priority among its jobs."""
        with self._lock:
            worst: dict[str, int] = {}
            for tenant, priority in self._job_class.values():
                worst[tenant] = max(priority, worst.get(tenant, priority))
            return worst

    def open(self, entry_id: Ref, job_id: str) -> None:
        with self._lock:
            self._job_entry[job_id] = [entry_id]

    def join(self, entry_id: Ref, job_id: str) -> bool:
        """Another entry for a job held here: kept beside its first, acknowledged with it. False when the job is
        not held here."""
        with self._lock:
            held = self._job_entry.get(job_id)
            if held is None:
                return False
            if entry_id not in held:
                held.append(entry_id)
            return True

    def take_slot(self, job_id: str, tenant: str = "", priority: int = 0) -> None:
        """Before the job of an open entry goes to the engine; blocks while the spare room is full too."""
        with self._room:
            self._room.wait_for(lambda: self._held < self._max_jobs + self._spare)
            self._held += 1
            self._job_class[job_id] = (tenant, priority)

    def close(self, job_id: str) -> None:
        """The job's end is recorded: free its slot, and acknowledge its entries."""
        refs = self._leave(job_id)
        if not refs:
            return
        if self.consumer.cluster:  # (master by master: one that does not answer holds no other's acks, nor the
            missed = self.consumer.ack_each(refs)  # lane's reports behind them)
            if missed:
                log.warning("entries %s not acknowledged (their master does not answer); they stay pending", missed)
            return
        try:
            call(lambda: self.consumer.ack(refs), attempts=ACK_ATTEMPTS, log=log, name="ack",
                 on_outage=self.consumer.note_outage)
        except RETRYABLE as exc:
            log.warning("entries %s not acknowledged (%s); they stay pending", refs, exc)

    def release(self, job_id: str) -> None:
        """The engine has finished the job, whose end waits for a replica before its entry is acknowledged
        (`close`): its slot is free for the next job meanwhile."""
        with self._lock:
            if self._job_class.pop(job_id, None) is not None:
                self._held -= 1
                self._room.notify_all()

    def forget(self, job_id: str) -> None:
        """The job is no longer this worker's: free its slot, and let its entry go unacknowledged."""
        self._leave(job_id)

    def _leave(self, job_id: str) -> list[Ref]:
        """Drop the job and its entries (and its slot, unless released already); the entries, none when the job
        was not held."""
        self.release(job_id)
        with self._lock:
            return self._job_entry.pop(job_id, [])

    def entries(self) -> list[Ref]:
        with self._lock:
            return [ref for refs in self._job_entry.values() for ref in refs]

    def idle(self) -> bool:
        """No job is running here."""
        with self._lock:
            return not self._job_entry

    def hand_back(self, idle_ms: int) -> None:
        """Make the entries still held claimable by other workers right away (they resume the jobs)."""
        refs = self.entries()
        if refs:
            self.consumer.hand_back(refs, idle_ms)
            log.info("handed back %d entries", len(refs))
