"""The output lane: a process of its own beside the engine. It turns per-step token-id deltas
into text (incrementally, with stop strings held back) and, per step, in one MULTI/EXEC holding
one STEP_SCRIPT call for all jobs: appends each chunk to the job's event stream, publishes it,
updates the job record and the saved token ids. Finished jobs get their terminal state; the engine
process hears back (`Done` to acknowledge the stream entry, `Abort` when a stop string ended a sequence).
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import signal
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.queues import Queue
from typing import Any

import orjson
import redis
from tokenizers import Tokenizer

from gpu_worker.cpu_affinity import release as release_cpus
from gpu_worker.detokenizer import Detokenizer
from gpu_worker.messages import Abort, Deltas, Done, LaneCommand, LaneReport, Register, Stop
from gpu_worker.token_text import TokenText
from shared import names
from shared.fair_queue import OUTPUT_COST
from shared.job_ops import FIRST_TOKEN, FRESH, Charges, JobOps, pack_ids, queue_replica_wait, step_write
from shared.jobs import FinishReason
from shared.lifecycle import die_with_parent
from shared.metrics import (
    E2E,
    GENERATION_TOKENS,
    ITL,
    PROMPT_TOKENS,
    QUEUE,
    REQUEST_SUCCESS,
    TTFT,
    Histograms,
)
from shared.redis_client import CLUSTER_TYPES, UNAVAILABLE, sync_client
from shared.retry import call
from shared.schemas import DELTA_SCHEMA, from_ipc
from shared.settings import Settings

log = logging.getLogger("conveyor.output_lane")


@dataclass
class JobState:
    detok: Detokenizer
    seq: int
    text_bytes: int  # length of the streamed text in UTF-8 bytes: where the next chunk goes
    n_tokens: int
    created_at: float
    prompt_tokens: int
    tenant: str = ""  # the fair-queue tenant charged for its tokens ('' none)
    weight: float = 1.0
    last_token_at: float = 0.0
    fresh: bool = True  # no write from this lane yet
    written: int = 0  # tokens written to Redis (ids and completion_tokens)
    held_ids: bytearray = field(default_factory=bytearray)  # packed ids not written yet
    held_text: str = ""  # text released by the detokenizer, not written yet
    logprob_bytes: int = 0  # length of the job's logprob entries written: where the next go
    held_logprobs: list[list[Any]] = field(default_factory=list)  # entries of tokens not written yet


class OutputLane:
    def __init__(self, settings: Settings, feedback: Queue[LaneReport], client: redis.Redis | None = None) -> None:
        self.client = client or sync_client(settings.redis_url, decode=False)
        self.ttl = settings.job_ttl_s
        self.jobs = JobOps(self.client, self.ttl)
        # one transaction per step on a single Redis; on a cluster a pipeline whose ends wait for a
        # replica (WAIT needs the writes' connection, which a cluster's transaction does not lend): each
        # call there is atomic, and a replayed step or finish is a no-op, so the order is enough
        self.cluster = isinstance(self.client, CLUSTER_TYPES)
        self.tokenizer = Tokenizer.from_file(os.path.join(settings.model_path, "tokenizer.json"))
        self.token_text = TokenText(self.tokenizer)
        self.feedback = feedback
        self.interval = settings.stream_interval
        self.states: dict[str, JobState] = {}
        self.metrics = Histograms()
        self._last_flush = time.monotonic()

    def register(self, job: Register) -> None:
        try:
            self._register(job)
        except Exception as exc:  # noqa: BLE001 - the job fails alone; the lane goes on
            log.exception("job %s could not be registered", job.job_id)
            self.jobs.fail(job.job_id, f"the output lane could not take the job: {exc}")
            self.feedback.put(Abort(job.job_id, FinishReason.error))
            self.feedback.put(Done(job.job_id))

    def _register(self, job: Register) -> None:
        detok = Detokenizer(self.tokenizer, list(job.stop))
        if job.resume_ids:
            detok.resume(list(job.resume_ids), job.emitted)
        st = JobState(detok, job.seq, len(job.emitted.encode()), len(job.resume_ids), job.created_at or time.time(),
                      job.prompt_tokens, job.tenant, job.weight, written=len(job.resume_ids),
                      logprob_bytes=job.logprob_bytes)
        self.states[job.job_id] = st
        if job.started:
            self.metrics.observe(QUEUE, time.time() - st.created_at)

    def flush_metrics(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_flush >= 1.0:
            self._last_flush = now
            pipe = self.client.pipeline(transaction=False)
            self.metrics.flush(pipe)
            try:
                pipe.execute()
            except redis.RedisError as exc:
                log.warning("metrics flush failed: %s", exc)

    def handle_deltas(self, data: bytes) -> None:
        pipe, done = self.build(data)
        self.commit(pipe, done)

    def build(self, data: bytes) -> tuple[Any, list[str]]:
        """The step's writes: one STEP_SCRIPT call for every job's chunk and ids, then the finishes."""
        rows = from_ipc(data, DELTA_SCHEMA).to_pylist()
        pipe = self.client.pipeline(transaction=not self.cluster)
        steps: dict[int, tuple[list[str], list[Any]]] = {}  # one step call per partition (one slot each)
        charges: dict[int, Charges] = defaultdict(dict)  # per partition, the new tokens per fair-queue tenant
        finishes: list[tuple[str, str, str, int]] = []
        done: list[str] = []
        prompts: list[tuple[str, bytes]] = []  # (job, its prompt's logprobs document): written once
        wall = time.time()
        for row in rows:
            job_id, ids, reason = row["job_id"], row["token_ids"], row["finish_reason"]
            st = self.states.get(job_id)
            if st is None:
                continue  # already finished here (a stop string ended it before the engine heard)
            flags = FRESH if st.fresh else 0
            hit = False
            try:
                emit, hit = st.detok.push(ids) if ids else ("", False)
            except Exception as exc:  # noqa: BLE001 - this job ends with an error, the step goes on
                log.exception("job %s: detokenizing failed", job_id)
                if reason is None:
                    self.feedback.put(Abort(job_id, FinishReason.error))
                finishes.append((job_id, FinishReason.error.value, f"detokenizing failed: {exc}", st.n_tokens))
                done.append(job_id)
                continue
            if ids:
                if st.n_tokens == 0:
                    flags |= FIRST_TOKEN
                    self.metrics.observe(TTFT, wall - st.created_at)
                elif st.last_token_at:
                    self.metrics.observe(ITL, (wall - st.last_token_at) / len(ids))
                st.last_token_at = wall
                st.held_ids += pack_ids(ids)
                st.n_tokens += len(ids)
                st.held_text += emit
                if row["logprobs"] is not None:
                    st.held_logprobs += self._entries(ids, row["logprobs"], row["top_ids"], row["top_logprobs"])
            if row["prompt_logprobs"] is not None:
                prompts.append((job_id, self._prompt_document(row)))
            if hit:
                if reason is None:
                    self.feedback.put(Abort(job_id, FinishReason.stop))
                reason = FinishReason.stop.value
            elif reason is not None:
                st.held_text += st.detok.matcher.flush()
            # Written now: the first token, the end, a fresh job's keys, else every `interval` tokens.
            if flags or reason is not None or st.n_tokens - st.written >= self.interval:
                packed, tok_off = bytes(st.held_ids), st.written * 4
                chunk, message, text_off, lp, lp_off = b"", b"", st.text_bytes, b"", st.logprob_bytes
                if st.held_text or st.held_logprobs:
                    st.seq += 1
                    chunk = st.held_text.encode()
                    st.text_bytes += len(chunk)
                    event: dict[str, Any] = {"seq": st.seq, "type": "token", "text": st.held_text}
                    if st.held_logprobs:
                        event["logprobs"] = st.held_logprobs
                        lp = b"".join(orjson.dumps(e) + b"\n" for e in st.held_logprobs)
                        st.logprob_bytes += len(lp)
                    message = orjson.dumps(event)
                if flags or packed or chunk or lp:
                    job_keys, job_args = step_write(job_id, flags, tok_off, packed, text_off, chunk, st.seq, message,
                                                    st.n_tokens, lp_off, lp)
                    p = names.job_partition(job_id)
                    keys, args = steps.setdefault(p, ([], []))
                    keys += job_keys
                    args += job_args
                    new = st.n_tokens - st.written
                    if st.tenant and new:
                        cost, served = charges[p].get(st.tenant, (0.0, 0))
                        charges[p][st.tenant] = (cost + new * OUTPUT_COST / st.weight, served + new)
                st.written, st.held_ids, st.held_text, st.held_logprobs = st.n_tokens, bytearray(), "", []
                st.fresh = st.fresh and not chunk and not packed and not lp
            if reason is not None:
                finishes.append((job_id, reason, row.get("error") or "", st.n_tokens))
                done.append(job_id)
                self.metrics.observe(E2E, wall - st.created_at)
                self.metrics.inc(GENERATION_TOKENS, st.n_tokens)
                self.metrics.inc(PROMPT_TOKENS, st.prompt_tokens)
                self.metrics.inc(f"{REQUEST_SUCCESS}:{reason}")
        for job_id, document in prompts:  # before the step that carries the job's first token
            pipe.set(names.prompt_logprobs_key(job_id), document, nx=True, ex=self.ttl)
        for p, (keys, args) in steps.items():
            self.jobs.step(keys, args, pipe, charges.get(p))
        for job_id, reason, error, n_tokens in finishes:  # after the step: a job's last chunk precedes its end
            self.jobs.finish(job_id, FinishReason(reason), error, {"completion_tokens": n_tokens}, pipe=pipe)
        if finishes and self.cluster:  # a job's end survives the loss of its master
            nodes = [self.client.get_node_from_key(names.job_key(job_id)) for job_id, *_ in finishes]
            for node in {n.name: n for n in nodes}.values():
                queue_replica_wait(pipe, node)
        return pipe, done

    def _entries(self, ids: list[int], chosen: list[float], top_ids: list[list[int]],
                 top_lps: list[list[float]]) -> list[list[Any]]:
        """Per token [id, text, logprob, [[id, text, logprob] per alternative, most likely first]]."""
        text = self.token_text
        return [[t, text(t), lp, [[a, text(a), alp] for a, alp in zip(ai, al)]]
                for t, lp, ai, al in zip(ids, chosen, top_ids, top_lps)]

    def _prompt_document(self, row: dict[str, Any]) -> bytes:
        """The prompt's text and its tokens' entries (the first token's logprob is null: nothing precedes it)."""
        ids = row["prompt_ids"] or []
        first = [[ids[0], self.token_text(ids[0]), None, []]] if ids else []
        entries = first + self._entries(ids[1:], row["prompt_logprobs"], row["prompt_top_ids"],
                                        row["prompt_top_logprobs"])
        return orjson.dumps({"text": self.tokenizer.decode(ids, skip_special_tokens=False), "tokens": entries})

    def commit(self, pipe: Any, done: list[str]) -> None:
        results = call(self._replayable(pipe), log=log, name="output lane write")
        for i, res in enumerate(results):
            if isinstance(res, Exception):
                log.warning("output write %d failed: %s", i, res)
        for job_id in done:
            del self.states[job_id]
            self.feedback.put(Done(job_id))

    def _replayable(self, pipe: Any) -> Callable[[], list[Any]]:
        """`pipe.execute`, retryable: a failed execute() empties the pipeline, so a retry replays
        the step's commands on a new one."""
        calls = _queued(pipe)
        first = [pipe]

        def execute() -> list[Any]:
            if first:
                results = first.pop().execute(raise_on_error=False)
            else:
                again = self.client.pipeline(transaction=not self.cluster)
                for args, options in calls:
                    again.pipeline_execute_command(*args, **options)
                results = again.execute(raise_on_error=False)
            for res in results:  # a cluster's pipeline answers an outage per command: try the whole step again
                if isinstance(res, UNAVAILABLE):
                    raise res
            return results  # type: ignore[no-any-return]

        return execute


def _queued(pipe: Any) -> list[tuple[Any, dict[str, Any]]]:
    """The commands queued on a pipeline, as (args, options): a plain one keeps them in its
    command_stack, a cluster's in its execution strategy's queue."""
    strategy = getattr(pipe, "_execution_strategy", None)
    if strategy is not None:
        return [(c.args, c.options) for c in strategy.command_queue]
    return list(pipe.command_stack)


def main(settings: Settings, inbox: Queue[LaneCommand], feedback: Queue[LaneReport],
         parent_pid: int | None = None) -> None:
    release_cpus()  # not confined to the engine's first core (gpu_worker/cpu_affinity.py)
    die_with_parent(signal.SIGTERM, parent_pid)  # an engine process killed outright takes its lane along
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine process decides when the lane stops
    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    lane = OutputLane(settings, feedback)
    while True:
        try:
            msg = inbox.get(timeout=1.0)
        except queue.Empty:
            lane.flush_metrics()
            continue
        match msg:
            case Register():
                lane.register(msg)
            case Deltas(data):
                lane.handle_deltas(data)
                lane.flush_metrics()
            case Stop():
                lane.flush_metrics(force=True)
                gc.freeze()  # the process exits next: no final collections over what it made (exit_quickly)
                return
