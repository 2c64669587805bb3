"""An inference worker process: reader lane -> engine loop -> output lane.

- reader lane (thread): XREADGROUP `tokenized`, start or resume each job, hand requests to
  the engine's inbox; keeps its in-flight entries fresh, claims a dead worker's entries.
- control lane (thread): cancellations from the API, as aborts into the inbox.
- engine loop (main thread): drains the inbox, steps, sends deltas. No Redis, no JSON.
- output lane (process): text, events, job records; reports back "done" and "abort".
A stream entry (several jobs) is acknowledged once all its jobs have a recorded end.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import random
import signal
import threading
import time
from typing import Any

import orjson
import pyarrow as pa
import redis

from gpu_worker import output_lane
from gpu_worker.engine import EngineConfig, Request, StepOutput
from gpu_worker.output_lane import unpack_ids
from shared import names
from shared.heartbeat import Heartbeat, new_worker_id
from shared.job_ops import JobOps
from shared.redis_client import sync_client
from shared.schemas import DELTA_SCHEMA, TOKENIZED_SCHEMA, from_ipc, to_ipc
from shared.settings import Settings
from shared.stream_consumer import Entry, StreamConsumer

log = logging.getLogger("conveyor.inference")


def build_engine(settings: Settings) -> Any:
    if settings.engine == "synthetic":
        from gpu_worker.engine.synthetic import SyntheticEngine

        return SyntheticEngine(settings.max_num_seqs)
    from gpu_worker.engine import LLMEngine

    return LLMEngine(EngineConfig(
        model=settings.model_path, device=settings.device, dtype=settings.dtype,
        max_num_seqs=settings.max_num_seqs, max_num_batched_tokens=settings.max_num_batched_tokens,
        kv_cache_mb=settings.kv_cache_mb, max_model_len=settings.max_model_len, threads=settings.torch_threads))


def encode_deltas(outs: list[StepOutput]) -> bytes:
    batch = pa.RecordBatch.from_pylist(
        [{"job_id": o.id, "token_ids": o.token_ids, "finish_reason": o.finish_reason, "error": o.error}
         for o in outs], schema=DELTA_SCHEMA)
    return to_ipc(batch)


class InferenceWorker:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.client = sync_client(settings.redis_url, decode=False)
        self.worker_id = new_worker_id(names.INFERENCE_POOL)
        self.consumer = StreamConsumer(self.client, names.TOKENIZED_STREAM, names.INFERENCE_GROUP, self.worker_id,
                                       names.INFERENCE_POOL, settings.claim_idle_ms, settings.delivery_limit)
        self.jobs = JobOps(self.client, settings.job_ttl_s)
        self.inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self.stopping = threading.Event()  # stop reading new work
        self.lock = threading.Lock()
        self.entry_jobs: dict[str, set[str]] = {}
        self.job_entry: dict[str, str] = {}
        self.capacity = threading.Semaphore(settings.max_num_seqs * 2)
        self.stats: dict[str, Any] = {"running": 0, "waiting": 0, "kv_cache_usage": 0.0, "steps": 0,
                                      "generated_tokens": 0, "jobs_started": 0, "jobs_resumed": 0}
        ctx = mp.get_context("spawn")
        self.to_lane: Any = ctx.Queue()
        self.from_lane: Any = ctx.Queue()
        self.lane = ctx.Process(target=output_lane.main, args=({}, self.to_lane, self.from_lane, os.getpid()),
                                name="output-lane", daemon=True)

    # --- reader lane -------------------------------------------------------------------
    def reader(self) -> None:
        next_upkeep = 0.0
        backoff = 0.1
        while not self.stopping.is_set():
            try:
                if time.monotonic() >= next_upkeep:
                    self.upkeep()
                    next_upkeep = time.monotonic() + self.settings.refresh_s
                if not self.capacity.acquire(timeout=0.5):
                    continue
                self.capacity.release()
                for entry in self.consumer.read(count=8, block_ms=500):
                    self.admit(entry)
                backoff = 0.1
            except redis.ConnectionError as exc:
                self.consumer.note_outage()
                log.warning("redis unavailable (%s); retrying in %.1fs", exc, backoff)
                self.stopping.wait(backoff + random.random() * backoff)
                backoff = min(backoff * 2, 5.0)
            except Exception:
                log.exception("reader lane error")
                time.sleep(0.5)

    def upkeep(self) -> None:
        with self.lock:
            mine = list(self.entry_jobs)
        self.consumer.refresh(mine)
        keep, dead = self.consumer.claim_stale(count=8)
        for entry in dead:
            self._fail_entry(entry, f"inference failed {entry.deliveries} times on this job's batch; "
                                    "moved to the dead-letter stream")
        for entry in keep:
            log.info("claimed %s (delivery %d) from a worker that stopped", entry.id, entry.deliveries)
            if not self.split(entry):
                self.admit(entry)

    def split(self, entry: Entry) -> bool:
        """A redelivered entry of several jobs goes back as one entry per job, so that a job that
        kills its worker again reaches the dead-letter stream alone and its batch-mates go on."""
        try:
            batch = from_ipc(_field(entry.fields, "batch"), TOKENIZED_SCHEMA)
        except Exception:  # noqa: BLE001 - admit() dead-letters it
            return False
        if batch.num_rows < 2:
            return False
        pipe = self.client.pipeline(transaction=True)
        for i in range(batch.num_rows):
            pipe.xadd(names.TOKENIZED_STREAM, {"batch": to_ipc(batch.slice(i, 1)), "jobs": 1})
        pipe.xack(names.TOKENIZED_STREAM, names.INFERENCE_GROUP, entry.id)
        pipe.execute()
        log.warning("split redelivered entry %s into %d entries of one job", entry.id, batch.num_rows)
        return True

    def _fail_entry(self, entry: Entry, reason: str) -> None:
        try:
            rows = from_ipc(_field(entry.fields, "batch"), TOKENIZED_SCHEMA).column("job_id").to_pylist()
        except Exception:
            return
        for job_id in rows:
            self.jobs.fail(job_id, reason)

    def admit(self, entry: Entry) -> None:
        try:
            batch = from_ipc(_field(entry.fields, "batch"), TOKENIZED_SCHEMA)
        except Exception as exc:
            self.consumer.dead_letter(entry, f"unreadable batch: {exc}")
            return
        started: list[tuple[dict[str, Any], int, int]] = []
        for row in batch.to_pylist():
            code, seq, created = self.jobs.start(row["job_id"], self.worker_id)
            if code in (1, 2):
                row["created_at"] = created
                started.append((row, code, seq))
        if not started:
            self.consumer.ack([entry.id])
            return
        with self.lock:
            self.entry_jobs[entry.id] = {row["job_id"] for row, _, _ in started}
            for row, _, _ in started:
                self.job_entry[row["job_id"]] = entry.id
        for row, code, seq in started:
            self.capacity.acquire()
            resume_ids: list[int] = []
            emitted = ""
            if code == 2:  # another worker began this job: continue from what it recorded
                pipe = self.client.pipeline(transaction=True)
                pipe.get(names.tokens_key(row["job_id"]))
                pipe.get(names.text_key(row["job_id"]))
                pipe.hget(names.job_key(row["job_id"]), "seq")
                raw_ids, text, rec_seq = pipe.execute()
                resume_ids, emitted = unpack_ids(raw_ids), (text or b"").decode()
                seq = int(rec_seq or 0)
                self.stats["jobs_resumed"] += 1
            self.stats["jobs_started"] += 1
            self.to_lane.put(("register", {"job_id": row["job_id"], "stop": row["stop"], "seq": seq,
                                           "resume_ids": resume_ids, "emitted": emitted,
                                           "created_at": row["created_at"], "prompt_tokens": len(row["prompt_ids"]),
                                           "started": code == 1}))
            self.inbox.put(("add", Request(
                id=row["job_id"], prompt_ids=row["prompt_ids"], max_tokens=row["max_tokens"],
                temperature=row["temperature"], top_p=row["top_p"], top_k=row["top_k"], seed=row["seed"],
                stop_token_ids=tuple(row["stop_token_ids"]), ignore_eos=row["ignore_eos"], resume_ids=resume_ids)))

    # --- control and feedback lanes ---------------------------------------------------------
    def control(self) -> None:
        while True:
            try:
                pubsub = self.client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(names.CONTROL_CHANNEL)
                for msg in pubsub.listen():
                    body = orjson.loads(msg["data"])
                    if body.get("op") == "cancel":
                        self.inbox.put(("abort", body["job_id"], "cancelled"))
            except redis.ConnectionError:
                time.sleep(0.5 + random.random())

    def feedback(self) -> None:
        while True:
            msg = self.from_lane.get()
            if msg[0] == "abort":
                self.inbox.put(msg)
            elif msg[0] == "done":
                self.job_done(msg[1])

    def job_done(self, job_id: str) -> None:
        with self.lock:
            entry_id = self.job_entry.pop(job_id, None)
            jobs = self.entry_jobs.get(entry_id or "")
            if jobs is None:
                return
            jobs.discard(job_id)
            complete = not jobs
            if complete:
                del self.entry_jobs[entry_id]  # type: ignore[arg-type]
        self.capacity.release()
        if complete:
            for attempt in range(20):
                try:
                    self.consumer.ack([entry_id])  # type: ignore[list-item]
                    break
                except redis.ConnectionError:
                    time.sleep(min(5.0, 0.1 * 2**attempt))

    # --- engine loop --------------------------------------------------------------------------
    def engine_loop(self, engine: Any) -> None:
        early_aborts: dict[str, float] = {}
        last_check = time.monotonic()
        while True:
            block = not engine.has_unfinished()
            while True:
                try:
                    cmd = self.inbox.get(timeout=0.2) if block else self.inbox.get_nowait()
                except queue.Empty:
                    break
                block = False
                if cmd[0] == "add":
                    req = cmd[1]
                    try:
                        engine.add_request(req)
                    except ValueError:
                        log.exception("request %s not added", req.id)  # already running here
                        continue
                    except Exception as exc:  # noqa: BLE001 - the request fails, the worker goes on
                        log.exception("request %s refused by the engine", req.id)
                        self.to_lane.put(("deltas", encode_deltas([StepOutput(
                            req.id, finish_reason="error", error=f"the engine refused the request: {exc}")])))
                        continue
                    if early_aborts.pop(req.id, None) is not None:
                        engine.abort_request(req.id, "cancelled")
                elif cmd[0] == "grace_over":
                    raise _GraceOver
                elif cmd[0] == "abort":
                    if not engine.abort_request(cmd[1], cmd[2]) and cmd[2] == "cancelled":
                        early_aborts[cmd[1]] = time.monotonic()  # may be on its way in
            if engine.has_unfinished():
                outs = engine.step()
                if outs:
                    self.to_lane.put(("deltas", encode_deltas(outs)))
                    self.stats["generated_tokens"] += sum(len(o.token_ids) for o in outs)
                self.stats["steps"] += 1
            now = time.monotonic()
            if now - last_check > 1.0:
                last_check = now
                self.stats.update(running=engine.num_running, waiting=engine.num_waiting,
                                  kv_cache_usage=round(engine.kv_usage(), 4))
                for job_id, t in list(early_aborts.items()):
                    if now - t > 30:
                        del early_aborts[job_id]
                if not self.lane.is_alive():
                    raise SystemExit("the output lane died; exiting so this worker's jobs are redelivered")
            if self.stopping.is_set() and not engine.has_unfinished():
                with self.lock:
                    if not self.job_entry:
                        return

    def hand_back(self) -> None:
        """Make entries we still hold claimable by other workers right away (they resume the jobs)."""
        with self.lock:
            ids = list(self.entry_jobs)
        if ids:
            self.client.xclaim(names.TOKENIZED_STREAM, names.INFERENCE_GROUP, self.worker_id, 0, ids,
                               idle=self.settings.claim_idle_ms + 1000, justid=True)
            log.info("handed back %d entries", len(ids))

    def run(self) -> int:
        self.consumer.ensure_group()
        self.lane.start()
        engine = build_engine(self.settings)
        for target in (self.control, self.feedback):
            threading.Thread(target=target, daemon=True, name=target.__name__).start()
        reader = threading.Thread(target=self.reader, daemon=True, name="reader")
        reader.start()
        hb = Heartbeat(self.client, names.INFERENCE_POOL, self.worker_id, self.settings.heartbeat_s,
                       lambda: dict(self.stats))
        hb.start()
        log.info("inference worker %s ready (%s engine)", self.worker_id, self.settings.engine)
        drain_deadline: list[float] = []

        def _stop(signum: int, _frame: Any) -> None:
            if not drain_deadline:
                log.info("signal %d: draining (grace %.0fs)", signum, self.settings.drain_grace_s)
                drain_deadline.append(time.monotonic() + self.settings.drain_grace_s)
                self.stopping.set()

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        timer = threading.Thread(target=self._drain_timer, args=(drain_deadline,), daemon=True)
        timer.start()
        try:
            self.engine_loop(engine)
        except _GraceOver:
            self.hand_back()
        finally:
            # let the lane write what it has, then stop it
            self.to_lane.put(("stop",))
            self.lane.join(timeout=10)
            hb.stop()
        log.info("inference worker %s stopped", self.worker_id)
        return 0

    def _drain_timer(self, deadline: list[float]) -> None:
        while not deadline:
            time.sleep(0.2)
        while time.monotonic() < deadline[0]:
            time.sleep(0.2)
        self.inbox.put(("grace_over",))


class _GraceOver(Exception):
    pass


def _field(fields: dict[Any, Any], name: str) -> bytes:
    v = fields.get(name.encode(), fields.get(name))
    return v if isinstance(v, bytes) else str(v).encode()


def main(settings: Settings) -> int:
    settings.require_model(weights=settings.engine != "synthetic")  # the synthetic engine still detokenizes
    return InferenceWorker(settings).run()
