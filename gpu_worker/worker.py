"""An inference worker process: reader lane -> engine loop -> output lane.

- reader lane (thread, reader.py): XREADGROUP `tokenized`, start or resume each job (admission.py),
  keep this worker's entries fresh, take over a dead worker's.
- control lane (thread, control.py): cancellations from the API, as aborts into the inbox.
- engine loop (main thread, engine_loop.py): drains the inbox, steps, hands each step's outputs to its
  sender (thread), which encodes them (Arrow) and puts them on the output lane's queue. No Redis, no JSON.
- output lane (process, output_lane.py): text, events, job records; reports `Done` and `Abort`
  back to the feedback lane (thread, feedback.py).
- ledger (ledger.py): a stream entry (several jobs) is acknowledged once all its jobs have a recorded end.
The messages between them are in messages.py. This module only wires them together.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
from multiprocessing.context import ForkContext, SpawnContext
from multiprocessing.queues import Queue
from queue import SimpleQueue
from types import FrameType
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from gpu_worker import output_lane
from gpu_worker.admission import Admission
from gpu_worker.control import ControlLane
from gpu_worker.engine import Engine, EngineConfig
from gpu_worker.engine.ngram import NgramConfig
from gpu_worker.engine_loop import LANE_DIED, EngineLoop
from gpu_worker.feedback import Feedback
from gpu_worker.ledger import EntryLedger
from gpu_worker.messages import EngineCommand, GraceOver, LaneCommand, LaneReport, Stop
from gpu_worker.reader import READ_BLOCK_MS, Reader
from gpu_worker.stats import WorkerStats
from shared import names, pool_fault
from shared.heartbeat import Heartbeat, new_worker_id
from shared.job_ops import JobOps
from shared.lifecycle import LANE_STOP_S, name_thread, named
from shared.masters import fail_fast
from shared.model_config import checkpoint_dtype, model_context, vocab_size
from shared.redis_client import sync_client
from shared.settings import Settings
from shared.stream_consumer import StreamConsumer

if TYPE_CHECKING:
    from gpu_worker.grammar import GrammarLoader

log = logging.getLogger("conveyor.inference")

READER_STOP_S = 5  # beyond its pop's block: for the reader to admit what it took before the worker hands it back
LANE_BEHIND_MAX = 64  # messages the output lane may be behind before the engine waits for it (backpressure)


def build_engine(settings: Settings) -> Engine:
    if settings.engine == "synthetic":
        from gpu_worker.engine.synthetic import SyntheticEngine

        return SyntheticEngine(settings.max_num_seqs)
    from gpu_worker.engine import LLMEngine

    path = settings.model_path
    own = model_context(path, 0)
    if "max_model_len" in settings.model_fields_set and settings.max_model_len > own:  # (the default is a cap)
        log.warning("MAX_MODEL_LEN=%d is past the model's own context (%d tokens): serving %d", settings.max_model_len,
                    own, own)
    engine: Engine = LLMEngine(EngineConfig(
        model=path, device=settings.device, dtype=settings.dtype, checkpoint_dtype=checkpoint_dtype(path),
        max_num_seqs=settings.max_num_seqs, max_num_batched_tokens=settings.max_num_batched_tokens,
        admit_every=settings.admit_every_steps, kv_cache_mb=settings.kv_cache_mb,
        max_model_len=model_context(path, settings.max_model_len),
        threads=settings.torch_threads, block_size=settings.kv_block_size, prefix_caching=settings.prefix_caching,
        cpu_kernels=settings.cpu_kernels, cpu_gemm=settings.cpu_gemm, max_loras=settings.max_loras,
        max_lora_rank=settings.max_lora_rank,
        speculative=NgramConfig(settings.num_speculative_tokens, settings.prompt_lookup_min,
                                settings.prompt_lookup_max) if settings.speculative == "ngram" else None))
    return engine


class InferenceWorker:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.client = sync_client(settings.redis_url, decode=False)
        # one model's pool (MODEL_NAME's, shared/served.py): its queue's `tokenized` streams, its registry
        self.pool = names.inference_pool(settings.model_key)
        self.worker_id = new_worker_id(self.pool)
        # (a cluster's) a client that does not retry and waits briefly: jobs are taken and started with it, so that
        # a master that stops answering holds back its own partitions' jobs only (shared/masters.py)
        fast = fail_fast(settings.redis_url)
        self.consumer = StreamConsumer(self.client, names.streams(names.TOKENIZED, settings.model_key),
                                       names.INFERENCE_GROUP, self.worker_id, self.pool, settings.claim_idle_ms,
                                       settings.delivery_limit, fast=fast)
        self.stats = WorkerStats()
        self.stopping = threading.Event()  # SIGTERM: read no new work, finish what runs here
        self.closed = threading.Event()  # the engine loop ended: the control lane stops
        self.inbox: SimpleQueue[EngineCommand] = SimpleQueue()
        ctx = lane_context()
        self.to_lane: Queue[LaneCommand] = ctx.Queue(maxsize=LANE_BEHIND_MAX)
        self.from_lane: Queue[LaneReport] = ctx.Queue()
        self.lane_outage = ctx.Value("d", 0.0, lock=False)  # since when the lane's writes fail (0: they do not)
        self.lane = ctx.Process(target=output_lane.main, args=(settings, self.to_lane, self.from_lane, os.getpid(),
                                                               self.lane_outage),
                                name="output-lane", daemon=True)
        # the engine's slots and a few more, ready when a slot frees (jobs taken beyond that would wait here,
        # out of the fair queue's reach), and as many again for jobs the engine makes room for at once: of a
        # tenant with no job here, or of a better priority than one its tenant runs here
        extra = max(2, settings.max_num_seqs // 8)
        self.ledger = EntryLedger(self.consumer, settings.max_num_seqs + extra, spare=extra)
        jobs = JobOps(self.client, settings.job_ttl_s, settings.model_key)
        loras = {n: m for n, m in settings.loras.items() if m.base_model_name == settings.served_model_name}
        self.admission = Admission(self.consumer, jobs, self.ledger, self.worker_id, self.inbox, self.to_lane,
                                   self.stats, self._grammar_loader, loras,
                                   JobOps(fast, settings.job_ttl_s, settings.model_key) if fast is not None else None,
                                   settings.served_model_name)
        self.reader = Reader(self.client, self.consumer, jobs, self.ledger, self.admission, settings.refresh_s,
                             self.stopping)
        self.control = ControlLane(self.client, self.inbox, self.closed)
        self.feedback = Feedback(self.from_lane, self.inbox, self.ledger)
        self._loader: GrammarLoader | None = None
        self._loader_lock = threading.Lock()

    def _grammar_loader(self) -> GrammarLoader:
        """The worker's grammar loader, made when the first grammar arrives (or at start with GRAMMAR_WARM)."""
        with self._loader_lock:
            if self._loader is None:
                from gpu_worker.grammar import GrammarLoader  # xgrammar loads only once a grammar arrives

                path = self.settings.model_path
                # (on the starts' client: a job's grammar is in its partition's slot, read right after its start)
                self._loader = GrammarLoader(path, self.admission.starts.client, vocab_size(path) or 0,
                                             self.settings.model_key)
            return self._loader

    def run(self) -> int:
        self.consumer.ensure_group()
        self.lane.start()
        if self.settings.grammar_warm:  # beside the engine's build
            threading.Thread(target=named("grammar-warm", lambda: self._grammar_loader().warm()), name="grammar-warm",
                             daemon=True).start()
        try:
            engine = build_engine(self.settings)
        except Exception as exc:  # its jobs' clients are told while no worker of the pool runs (shared/pool_fault.py)
            context = f"loading {self.settings.model_path}: "  # (another architecture: the engine's error names it)
            pool_fault.report(self.client, self.pool, exc, context)
            # one line, each time the supervisor starts it again (the traceback with LOG_LEVEL=DEBUG)
            log.debug("the model did not load", exc_info=True)
            raise SystemExit(f"{context}{pool_fault.describe(exc)}") from None
        pool_fault.clear(self.client, self.pool)
        self.stats.batch_invariant = engine.batch_invariant
        if not engine.batch_invariant:  # said at every start, and in its heartbeat (`conveyor status`, /metrics)
            log.warning("this worker's engine is not batch-invariant (CUDA, CPU_KERNELS=false, or a CPU kernel that "
                        "did not build: see the warnings above): a seeded request's text can change with what runs "
                        "beside it")
        loop = EngineLoop(engine, self.inbox, self.send_to_lane, self.stats, self.stopping,
                          self.ledger.idle, self.lane.is_alive)
        # a drain from here on, before the reader takes a job: the handler of a process still starting ends it at
        # once (infra/cli.py), which would leave whatever the reader had taken to wait out CLAIM_IDLE_MS
        signal.signal(signal.SIGTERM, self._drain)
        signal.signal(signal.SIGINT, self._drain)
        lanes = {name: threading.Thread(target=named(name, target), name=name, daemon=True)
                 for name, target in (("control", self.control.run), ("feedback", self.feedback.run),
                                      ("reader", self.reader.run), ("drain-timer", self._drain_timer))}
        for lane in lanes.values():
            lane.start()
        hb = Heartbeat(self.client, self.pool, self.worker_id, self.settings.heartbeat_s,
                       self.stats.as_dict, self.lane_writes)
        hb.start()
        name_thread("engine-loop")  # torch's compute threads, started with the engine, keep the process name
        log.info("inference worker %s ready (%s engine, model %s)", self.worker_id, self.settings.engine,
                 self.settings.served_model_name)
        try:
            loop.run()
            # what this worker still holds goes back to the others now, rather than after CLAIM_IDLE_MS: the jobs
            # running when the grace ran out, and any the reader took after the loop found nothing left to run
            # (its pop was under way as the drain began: a job that arrived then would otherwise wait a claim
            # timeout for a worker started for it)
            lanes["reader"].join(timeout=READ_BLOCK_MS / 1000 + READER_STOP_S)
            self.ledger.hand_back(self.settings.claim_idle_ms + 1000)
        finally:
            self.closed.set()
            with contextlib.suppress(queue.Full):  # the lane writes what it has, then exits
                self.to_lane.put(Stop(), timeout=LANE_STOP_S)
            self.lane.join(timeout=LANE_STOP_S)
            if self.lane.is_alive():
                self.stop_lane()
            # a lane that died (or was stopped) reads nothing more: the exit must not wait on its full pipe,
            # or this worker would live on, refreshing its entries, and its jobs would never be redelivered
            self.to_lane.cancel_join_thread()
            hb.stop()
        log.info("inference worker %s stopped", self.worker_id)
        return 0

    def lane_writes(self) -> bool:
        """Whether the output lane gets its writes through: none has failed for WRITE_OUTAGE_S."""
        since = self.lane_outage.value
        return not since or time.time() - since < self.settings.write_outage_s

    def send_to_lane(self, cmd: LaneCommand) -> None:
        """The engine's output, in order; while the lane is LANE_BEHIND_MAX messages behind, the engine
        waits for it rather than queue without bound. A lane that died ends the wait."""
        while True:
            try:
                self.to_lane.put(cmd, timeout=1.0)
                return
            except queue.Full:
                if not self.lane.is_alive():
                    raise SystemExit(LANE_DIED) from None

    def stop_lane(self) -> None:
        """The lane is still behind on its queue: stop it, and drop what it was not sent (else the
        exit waits on a full pipe). Only the writes of jobs still unacknowledged go missing: whoever
        resumes a job continues from what was recorded."""
        log.warning("the output lane did not stop within %ds; stopping it", LANE_STOP_S)
        self.lane.terminate()

    def _drain(self, signum: int, _frame: FrameType | None) -> None:
        if not self.stopping.is_set():
            log.info("signal %d: draining (grace %.0fs)", signum, self.settings.drain_grace_s)
            self.stopping.set()

    def _drain_timer(self) -> None:
        self.stopping.wait()
        time.sleep(self.settings.drain_grace_s)
        self.inbox.put(GraceOver())


def lane_context() -> ForkContext | SpawnContext:
    """How the output lane's process starts: forked while this process is still one thread without torch (as a
    worker is when it starts its lane, before its engine: the lane inherits the modules imported, ~0.5 CPU-s less
    a start than a fresh interpreter's), else spawned: a fork beside running threads (OpenMP's among them) can
    inherit a lock some thread held."""
    safe = threading.active_count() == 1 and "torch" not in sys.modules
    return mp.get_context("fork") if safe else mp.get_context("spawn")


def main(settings: Settings) -> int:
    try:
        settings.require_model(weights=settings.engine != "synthetic")  # the synthetic engine still detokenizes
    except SystemExit as exc:
        with contextlib.suppress(RedisError):  # (no Redis answers either: the log says it all)
            pool_fault.report(sync_client(settings.redis_url, retries=0, wait_s=2),
                              names.inference_pool(settings.model_key), exc)
        raise
    return InferenceWorker(settings).run()
