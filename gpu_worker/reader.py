"""The reader lane: the next jobs from the fair queue (shared/fair_queue.py), as many as the engine has
room for, and upkeep every `refresh_s`: keep this worker's entries fresh, take over the entries of a
worker that died."""

from __future__ import annotations

import logging
import threading
import time

import redis

from gpu_worker.admission import Admission, entry_request
from gpu_worker.ledger import EntryLedger
from shared.fair_queue import FairQueue
from shared.job_ops import JobOps
from shared.masters import Elsewhere
from shared.redis_client import RETRYABLE
from shared.retry import run_loop
from shared.stream_consumer import Entry, Ref, StreamConsumer

log = logging.getLogger("conveyor.inference")

READ_COUNT = 8
READ_BLOCK_MS = 500
ROOM_WAIT_S = 0.1  # a full worker looks this often for a job the engine would make room for


class Reader:
    def __init__(self, client: redis.Redis, consumer: StreamConsumer, jobs: JobOps, ledger: EntryLedger,
                 admission: Admission, refresh_s: float, stopping: threading.Event) -> None:
        self.client, self.consumer, self.jobs, self.ledger = client, consumer, jobs, ledger
        self.queue = FairQueue(client, consumer.consumer, jobs.model, consumer.masters)  # its model's queue
        self.admission, self.refresh_s, self.stopping = admission, refresh_s, stopping
        self._next_upkeep = 0.0
        # (a cluster's) entries taken whose admission met their master not answering: admitted once it answers
        self.held: dict[Ref, Entry] = {}
        consumer.on_dead = self.fail_dead  # the job fails before its entry is dead-lettered

    def run(self) -> None:
        run_loop(self.step, self.stopping, log, "reader lane", on_outage=self.consumer.note_outage)

    def step(self) -> None:
        if time.monotonic() >= self._next_upkeep:
            self.upkeep()
            self._next_upkeep = time.monotonic() + self.refresh_s
        self._readmit(self.consumer.lost(known=set(self.ledger.entries()) | set(self.held)),
                      "its pop's reply was lost with a master that stopped answering")
        for entry in [e for e in self.held.values() if not self.consumer.masters.is_down(e.stream)]:
            self._admit(entry)
        if self.ledger.has_room(ROOM_WAIT_S):
            # only what can start soon: a job taken waits here in the engine's order, out of the fair queue's reach
            entries = self.queue.pop(count=max(1, min(READ_COUNT, self.ledger.free())), block_ms=READ_BLOCK_MS)
        elif self.ledger.spare() > 0:
            # every slot is taken: a job may still come in if its tenant has none here, or if its priority is
            # better than the worst its tenant holds here; the engine gives it the slot of the tenant running
            # the most, or of its tenant's job of that worse priority (gpu_worker/engine/scheduler.py)
            entries = self.queue.pop(count=1, block_ms=None, skip=self.ledger.worst_priorities())
        else:
            return
        for entry in entries:
            self._admit(entry)

    def _admit(self, entry: Entry) -> None:
        """Admit the entry; on a cluster, one whose master does not answer is held (and the rest go on)."""
        if self.consumer.masters.is_down(entry.stream):  # (found so meanwhile: not waited on again)
            self.held[entry.ref] = entry
            return
        try:
            self.admission.admit(entry)
        except Elsewhere as exc:  # (a registry's master does not answer: this entry's own is not blamed)
            if entry.ref not in self.held:
                log.warning("admission of %s held until the master of %s answers", entry.id, exc)
            self.held[entry.ref] = entry
        except RETRYABLE as exc:
            if not self.consumer.cluster:
                raise
            self.consumer.masters.failed_key(entry.stream, exc)
            if entry.ref not in self.held:
                log.warning("admission of %s held until its master answers: %s", entry.id, exc)
            self.held[entry.ref] = entry
        else:
            self.held.pop(entry.ref, None)

    def upkeep(self) -> None:
        self.consumer.refresh(self.ledger.entries())
        keep, _ = self.consumer.claim_stale(count=READ_COUNT)
        for entry in keep:
            log.info("claimed %s (delivery %d) from a worker that stopped", entry.id, entry.deliveries)
            self._admit(entry)
        self.readmit_forgotten()

    def readmit_forgotten(self) -> None:
        """Entries of this worker's own that no ledger holds: read just before a Redis outage cut their
        admission off. Held entries are refreshed every refresh_s, so only forgotten ones idle this long."""
        own, _ = self.consumer.retry_own(self.consumer.claim_idle_ms, count=READ_COUNT)
        self._readmit(own, "its first admission was cut off")

    def _readmit(self, own: list[Entry], why: str) -> None:
        """Admit this worker's own entries that no ledger holds."""
        held = set(self.ledger.entries()) | set(self.held) if own else set()  # refs: (stream, id)
        for entry in own:
            if entry.ref not in held:
                log.warning("admitting %s again: %s", entry.id, why)
                self._admit(entry)

    def fail_dead(self, entry: Entry) -> None:
        self.fail_entry(entry, f"inference failed {entry.deliveries} times on this job's batch; "
                               "moved to the dead-letter stream")

    def fail_entry(self, entry: Entry, reason: str) -> None:
        try:
            job_id = entry_request(entry).id
        except Exception:  # noqa: BLE001 - an unreadable entry names no job to fail
            return
        self.jobs.fail(job_id, reason)
