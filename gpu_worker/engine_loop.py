"""The engine loop: drain the inbox (add, abort), step the engine, send the step's token-id deltas
to the output lane. It never touches Redis or JSON."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from gpu_worker.engine import Engine, Request, StepOutput
from gpu_worker.messages import Abort, Add, Deltas, EngineCommand, GraceOver, LaneCommand
from gpu_worker.stats import WorkerStats
from shared.jobs import FinishReason

log = logging.getLogger("conveyor.inference")

IDLE_WAIT_S = 0.2  # an idle engine waits this long for a command, then checks whether it drained
LANE_DIED = "the output lane died; exiting so this worker's jobs are redelivered"
CHECK_EVERY_S = 1.0  # stats, early aborts, the output lane's health
EARLY_ABORT_TTL_S = 30.0  # how long a cancel for a job not yet added waits for it


class EngineLoop:
    def __init__(self, engine: Engine, inbox: queue.SimpleQueue[EngineCommand], send: Callable[[LaneCommand], None],
                 stats: WorkerStats, stopping: threading.Event, idle: Callable[[], bool],
                 lane_alive: Callable[[], bool]) -> None:
        self.engine, self.inbox, self.send, self.stats = engine, inbox, send, stats
        self.stopping, self.idle, self.lane_alive = stopping, idle, lane_alive
        self.early_aborts: dict[str, float] = {}  # cancelled before its Add arrived: job id -> when
        self._last_check = time.monotonic()

    def run(self) -> bool:
        """Until drained (stopping, and no job running here): True; False if the grace period ended first."""
        while True:
            if not self.take_commands():
                return False
            if self.engine.has_unfinished():
                self.step()
            now = time.monotonic()
            if now - self._last_check > CHECK_EVERY_S:
                self._last_check = now
                self.check(now)
            if self.stopping.is_set() and not self.engine.has_unfinished() and self.idle():
                return True

    def take_commands(self) -> bool:
        """Everything waiting in the inbox (an idle engine waits briefly for the first); False on GraceOver."""
        block = not self.engine.has_unfinished()
        while True:
            try:
                cmd = self.inbox.get(timeout=IDLE_WAIT_S) if block else self.inbox.get_nowait()
            except queue.Empty:
                return True
            block = False
            match cmd:
                case Add(request):
                    self.add(request)
                case Abort(job_id, reason):
                    self.abort(job_id, reason)
                case GraceOver():
                    return False

    def add(self, req: Request) -> None:
        try:
            self.engine.add_request(req)
        except ValueError:
            log.exception("request %s not added", req.id)  # already running here
            return
        except Exception as exc:  # noqa: BLE001 - the request fails, the worker goes on
            log.exception("request %s refused by the engine", req.id)
            self.send(Deltas.of([StepOutput(req.id, finish_reason=FinishReason.error.value,
                                            error=f"the engine refused the request: {exc}")]))
            return
        if self.early_aborts.pop(req.id, None) is not None:
            self.engine.abort_request(req.id, FinishReason.cancelled.value)

    def abort(self, job_id: str, reason: FinishReason) -> None:
        if not self.engine.abort_request(job_id, reason.value) and reason is FinishReason.cancelled:
            self.early_aborts[job_id] = time.monotonic()  # its Add may be on its way

    def step(self) -> None:
        outs = self.engine.step()
        if outs:
            self.send(Deltas.of(outs))
            self.stats.generated_tokens += sum(len(o.token_ids) for o in outs)
        self.stats.steps += 1

    def check(self, now: float) -> None:
        self.stats.running = self.engine.num_running
        self.stats.waiting = self.engine.num_waiting
        self.stats.kv_cache_usage = round(self.engine.kv_usage(), 4)
        self.stats.preemptions, self.stats.fair_preemptions, self.stats.priority_preemptions = self.engine.preemptions()
        self.stats.draft_tokens, self.stats.accepted_tokens = self.engine.speculation()
        for job_id, t in list(self.early_aborts.items()):
            if now - t > EARLY_ABORT_TTL_S:
                del self.early_aborts[job_id]
        if not self.lane_alive():
            raise SystemExit(LANE_DIED)
