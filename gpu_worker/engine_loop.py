"""The engine loop: drain the inbox (add, abort), step the engine, hand the step's outputs to the sender,
a thread that encodes them (Arrow) and puts them on the output lane's queue. The loop never touches Redis
or JSON, and never waits on an encoding."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

from gpu_worker.engine import Engine, StepOutput
from gpu_worker.messages import Abort, Add, Deltas, EngineCommand, GraceOver, LaneCommand
from gpu_worker.stats import WorkerStats
from shared.jobs import FinishReason
from shared.lifecycle import named
from shared.schemas import Request

log = logging.getLogger("conveyor.inference")

IDLE_WAIT_S = 0.2  # an idle engine waits this long for a command, then checks whether it drained
LANE_DIED = "the output lane died; exiting so this worker's jobs are redelivered"
CHECK_EVERY_S = 1.0  # stats, early aborts, the output lane's health
EARLY_ABORT_TTL_S = 30.0  # how long a cancel for a job not yet added waits for it
SEND_AHEAD_MAX = 8  # steps handed to the sender, not yet on the lane's queue, before the engine waits for it
SEND_DRAIN_S = 10.0  # how long the loop's end waits for the sender to put what it was handed


class Sender:
    """A thread between the engine loop and the output lane: encodes each step's outputs (`Deltas.of`) and
    puts them on the lane's queue (`send`), in the order handed. The hand-off is bounded: while SEND_AHEAD_MAX
    steps wait, `put` waits (the lane is behind; its own queue is full). A send that fails (the lane died:
    `send` raises) ends the thread, and every later `put` exits the worker, as a dead lane does."""

    def __init__(self, send: Callable[[LaneCommand], None], ahead_max: int = SEND_AHEAD_MAX) -> None:
        self._send, self._ahead_max = send, ahead_max
        self._steps: deque[list[StepOutput]] = deque()  # the first one is being sent
        self._cond = threading.Condition()
        self.failed: BaseException | None = None
        threading.Thread(target=named("output-sender", self._run), name="output-sender", daemon=True).start()

    def put(self, outs: list[StepOutput]) -> None:
        with self._cond:
            while len(self._steps) >= self._ahead_max and self.failed is None:
                self._cond.wait(1.0)
            if self.failed is not None:
                raise SystemExit(LANE_DIED)
            self._steps.append(outs)
            self._cond.notify_all()

    def drain(self, timeout: float = SEND_DRAIN_S) -> bool:
        """Wait until every step handed over is on the lane's queue; False if that took longer, or failed."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._steps or self.failed is not None, timeout) and \
                self.failed is None

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: bool(self._steps))
                    outs = self._steps[0]
                self._send(Deltas.of(outs))
                with self._cond:
                    self._steps.popleft()
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - the lane died (SystemExit), or encoding failed: the worker exits
            if not isinstance(exc, SystemExit):
                log.exception("sending a step's outputs to the output lane failed")
            with self._cond:
                self.failed = exc
                self._cond.notify_all()


class EngineLoop:
    def __init__(self, engine: Engine, inbox: queue.SimpleQueue[EngineCommand], send: Callable[[LaneCommand], None],
                 stats: WorkerStats, stopping: threading.Event, idle: Callable[[], bool],
                 lane_alive: Callable[[], bool]) -> None:
        self.engine, self.inbox, self.stats = engine, inbox, stats
        self.sender = Sender(send)
        self.stopping, self.idle, self.lane_alive = stopping, idle, lane_alive
        self.early_aborts: dict[str, float] = {}  # cancelled before its Add arrived: job id -> when
        self._last_check = time.monotonic()

    def run(self) -> bool:
        """Until drained (stopping, and no job running here): True; False if the grace period ended first.
        Either way, what the engine produced is on the lane's queue when it returns."""
        try:
            return self._run()
        finally:
            if not self.sender.drain():
                log.warning("the sender did not put the last steps on the output lane's queue")

    def _run(self) -> bool:
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
            self.sender.put([StepOutput(req.id, finish_reason=FinishReason.error,
                                        error=f"the engine refused the request: {exc}")])
            return
        if self.early_aborts.pop(req.id, None) is not None:
            self.engine.abort_request(req.id, FinishReason.cancelled)

    def abort(self, job_id: str, reason: FinishReason) -> None:
        if not self.engine.abort_request(job_id, reason) and reason is FinishReason.cancelled:
            self.early_aborts[job_id] = time.monotonic()  # its Add may be on its way

    def step(self) -> None:
        outs = self.engine.step()
        if outs:
            self.sender.put(outs)
            self.stats.generated_tokens += sum(len(o.token_ids) for o in outs)
        self.stats.steps += 1

    def check(self, now: float) -> None:
        self.stats.running = self.engine.num_running
        self.stats.waiting = self.engine.num_waiting
        self.stats.kv_cache_usage = round(self.engine.kv_usage(), 4)
        self.stats.preemptions, self.stats.fair_preemptions, self.stats.priority_preemptions = self.engine.preemptions()
        self.stats.draft_tokens, self.stats.accepted_tokens = self.engine.speculation()
        self.stats.lora_resident, self.stats.lora_loads, self.stats.lora_evictions = self.engine.lora_counts()
        for job_id, t in list(self.early_aborts.items()):
            if now - t > EARLY_ABORT_TTL_S:
                del self.early_aborts[job_id]
        if not self.lane_alive() or self.sender.failed is not None:
            raise SystemExit(LANE_DIED)
