"""The entry ledger forgets a job the output lane dropped (its record gone, or another worker's now): its
slot frees, and its entry, which another consumer may hold by now, is never acknowledged here."""

from __future__ import annotations

from gpu_worker.ledger import EntryLedger


class Consumer:
    cluster = False  # (one Redis: acknowledged in one call, retried through an outage)

    def __init__(self) -> None:
        self.acked: list[str] = []

    def ack(self, refs: list[str]) -> None:
        self.acked += refs

    def note_outage(self) -> None:
        pass


def test_a_forgotten_job_frees_its_slot_and_its_entry_is_never_acknowledged() -> None:
    consumer = Consumer()
    ledger = EntryLedger(consumer, max_jobs=2)  # type: ignore[arg-type]
    ledger.open("e1", "j1")
    ledger.take_slot("j1")
    ledger.forget("j1")
    assert consumer.acked == [] and ledger.entries() == [] and ledger.idle() and ledger.free() == 2
    ledger.close("j1")  # a late report changes nothing
    assert consumer.acked == []


def test_a_released_slot_frees_at_once_and_its_entry_waits_for_the_jobs_end() -> None:
    """On a cluster the engine has finished a job whose end waits for a replica (`Ended`, then `Done`): its slot is
    free for the next job at once, its entry acknowledged only at Done, and the slot is not freed twice."""
    consumer = Consumer()
    ledger = EntryLedger(consumer, max_jobs=1)  # type: ignore[arg-type]
    ledger.open("e1", "j1")
    ledger.take_slot("j1")
    ledger.release("j1")
    assert ledger.free() == 1 and ledger.entries() == ["e1"] and consumer.acked == [] and not ledger.idle()
    ledger.open("e2", "j2")
    ledger.take_slot("j2")
    ledger.close("j1")
    assert consumer.acked == ["e1"] and ledger.free() == 0 and ledger.entries() == ["e2"]


def test_a_forgotten_jobs_entry_stays_unacknowledged_while_the_others_are() -> None:
    """Jobs ending here acknowledge their own entries, not the dropped job's: that entry, if still this worker's,
    is admitted again later (Reader.readmit_forgotten) and start.lua says what is left to run."""
    consumer = Consumer()
    ledger = EntryLedger(consumer, max_jobs=2)  # type: ignore[arg-type]
    for entry, job_id in (("e1", "j1"), ("e2", "j2")):
        ledger.open(entry, job_id)
        ledger.take_slot(job_id)
    ledger.forget("j1")
    assert ledger.entries() == ["e2"] and ledger.free() == 1  # no longer refreshed; j2 runs here
    ledger.close("j2")
    assert consumer.acked == ["e2"] and ledger.entries() == [] and ledger.idle()
    ledger.open("e1", "j1")  # the same entry admitted again: acknowledged like any
    ledger.take_slot("j1")
    ledger.close("j1")
    assert consumer.acked == ["e2", "e1"] and ledger.free() == 2
