"""The feedback lane: what the output lane reports back. An abort (a stop string hit, a job the
lane failed) goes to the engine; a job the engine has finished frees its slot (`Ended`), and its recorded end
closes it in the ledger, which acknowledges its entries (on a cluster, once a replica has the end); a job dropped
(no longer this worker's) is forgotten there, its entry never acknowledged."""

from __future__ import annotations

from multiprocessing.queues import Queue
from queue import SimpleQueue

from gpu_worker.ledger import EntryLedger
from gpu_worker.messages import Abort, Done, Dropped, Ended, EngineCommand, LaneReport


class Feedback:
    def __init__(self, reports: Queue[LaneReport], inbox: SimpleQueue[EngineCommand], ledger: EntryLedger) -> None:
        self.reports, self.inbox, self.ledger = reports, inbox, ledger

    def run(self) -> None:
        while True:
            match self.reports.get():
                case Abort() as abort:
                    self.inbox.put(abort)
                case Done(job_id):
                    self.ledger.close(job_id)
                case Dropped(job_id):
                    self.ledger.forget(job_id)
                case Ended(job_id):
                    self.ledger.release(job_id)
