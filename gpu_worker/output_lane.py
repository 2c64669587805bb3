"""The output lane: a process of its own beside the engine. It turns per-step token-id deltas
into text (incrementally, with stop strings held back) and, per step, one STEP_SCRIPT call per partition for
its jobs: appends each chunk to the job's event stream, publishes it (its `token` event in the very bytes the
job API streams: `token_message`), updates the job record and the saved token ids. A step is one MULTI/EXEC on a
single Redis; on a cluster each partition's writes go on their own (gpu_worker/backlog.py), so that a master's
outage holds only its own partitions' streams. Finished jobs get their terminal state; the engine
process hears back (`Done` to acknowledge the stream entry, `Abort` when a stop string ended a sequence,
`Dropped` for a job its step or finish found no longer this worker's: `settle`). On a Redis Cluster a job's
`Done` waits until a replica has its end, confirmed off this loop (gpu_worker/fencer.py).
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import signal
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.queues import Queue
from multiprocessing.sharedctypes import Synchronized
from typing import Any

import orjson
import redis
from tokenizers import Tokenizer

from gpu_worker.backlog import BEHIND_REPLAYS, Backlog, Ending, Unit, behind, send
from gpu_worker.cpu_affinity import release as release_cpus
from gpu_worker.detokenizer import Detokenizer
from gpu_worker.fencer import Fencer
from gpu_worker.job_trace import JobTrace
from gpu_worker.messages import Abort, Deltas, Done, Dropped, Ended, LaneCommand, LaneReport, Register, Stop
from gpu_worker.token_text import TokenText
from shared import names, tracing
from shared.events import token_message
from shared.fair_queue import OUTPUT_COST
from shared.job_ops import FIRST_TOKEN, FRESH, JobOps, Write, pack_ids, step_write
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
    Flusher,
    Histograms,
)
from shared.redis_client import CLUSTER_TYPES, RETRYABLE, heal, sync_client
from shared.retry import call
from shared.scripts.codes import FinishCode, FinishReply, StepCode, StepReply
from shared.settings import Settings

log = logging.getLogger("conveyor.output_lane")

# replies after which a job is no longer this worker's to write: nothing of it was written
REFUSED = frozenset({StepCode.no_such_job, StepCode.not_owner, StepCode.ended})
NOT_ENDED_HERE = frozenset({FinishCode.no_such_job, FinishCode.not_owner})
# a job's last writes that the lane keeps to write again where its record lost them (`_heal`): a failover loses what
# its replica had not copied yet, the last moments of output; a loss reaching further back fails the job
HISTORY_WRITES = 256
# a step's writes are tried again at most this far apart through an outage of a single Redis (its restart, its
# refusing writes): every stream waits on them, at most this long after Redis takes writes again
WRITE_RETRY_CAP_S = 1.0
# on a cluster a step's writes meet a master that does not answer for at most this long (then its partitions' writes
# wait in the backlog while the others' go on): once, when it stops answering. An answer later than this is only a
# replay when they are sent again; the backlog, off the lane's loop, waits longer (HELD_TIMEOUT_S)
WRITE_TIMEOUT_S = 0.5
HELD_TIMEOUT_S = 2.0
ENDS_AT_STOP_S = 8.0  # how long a stopping lane waits for its last ends to be confirmed (the worker waits 10 s)
LOST = "part of the output was not recorded (a Redis failover lost earlier writes, or a write failed): it is incomplete"


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
    worker: str = ""  # the worker that took it: its writes are refused once the record names another
    owner: str = ""  # the tenant that submitted it: its finish names that tenant's keys
    trace: JobTrace | None = None  # a traced job's spans (gpu_worker/job_trace.py)
    stop: str = ""  # the stop string that ended it ('' none): its record's `stop_sequence`
    ended: bool = False  # its end is written, or waits to be (held by an outage): later rows of it are late
    # its stages' times (unix s), kept in its record at its end (the dashboard's timeline): tokenizing began, it
    # was queued, the engine first scheduled it (this worker's attempt)
    stages: dict[str, float] = field(default_factory=dict)
    # its last writes, as sent (`step_write`), oldest first: what `_heal` sends again
    history: deque[Write] = field(default_factory=lambda: deque(maxlen=HISTORY_WRITES))


@dataclass
class StepWrites:
    """One step's writes, gathered job by job before any is queued (`OutputLane.build`)."""

    calls: dict[int, Write] = field(default_factory=dict)  # per partition (one slot each), its step call's keys, args
    jobs: dict[int, list[str]] = field(default_factory=lambda: defaultdict(list))  # per partition, its call's jobs
    finishes: list[Ending] = field(default_factory=list)
    done: list[str] = field(default_factory=list)  # the jobs ending in this step
    prompts: list[tuple[str, bytes]] = field(default_factory=list)  # (job, its prompt's logprobs document): once

    def add(self, job_id: str, write: Write) -> None:
        """The job's part of its partition's step call."""
        p = names.job_partition(job_id)
        keys, args = self.calls.setdefault(p, ([], []))
        keys += write[0]
        args += write[1]
        self.jobs[p].append(job_id)

    def end(self, job_id: str, reason: FinishReason, error: str, st: JobState) -> None:
        st.ended = True
        fields: dict[str, Any] = {"completion_tokens": st.n_tokens}
        fields.update((k, repr(v)) for k, v in st.stages.items() if v)
        if st.stop:
            fields["stop_sequence"] = st.stop
        self.finishes.append((job_id, reason, error, fields, st.worker, st.owner, (st.seq, st.written)))
        self.done.append(job_id)


class OutputLane:
    def __init__(self, settings: Settings, feedback: Queue[LaneReport], client: redis.Redis | None = None,
                 outage: Synchronized[float] | None = None) -> None:
        self.client = client or sync_client(settings.redis_url, decode=False)
        self.outage = outage  # since when (unix s) this lane's writes fail; 0: they do not
        self.ttl = settings.job_ttl_s
        self.jobs = JobOps(self.client, self.ttl, settings.model_key)
        # one transaction per step on a single Redis; on a cluster a pipeline (a transaction there would need
        # one slot): each call is atomic, and a replayed step or finish is a no-op, so the order is enough
        self.cluster = isinstance(self.client, CLUSTER_TYPES)
        # on a cluster, steps are sent with a client that meets an outage at once (no retry, a read timeout), and
        # the writes that met one are sent again off this loop, their partitions' next ones after them
        self.fast: Any = None
        self.backlog: Backlog | None = None
        self.down: set[str] = set()  # masters the fast client found not answering: their partitions' units wait
        if self.cluster:
            self.fast = sync_client(settings.redis_url, decode=False, retries=0, timeout=WRITE_TIMEOUT_S)
            # (its own loop backs off between tries: a client's retries would only make each try longer)
            self.backlog = Backlog(sync_client(settings.redis_url, decode=False, retries=0, timeout=HELD_TIMEOUT_S),
                                   self._outage_began, self._back)
        # on a cluster the ends a step wrote are confirmed on a replica off this loop (gpu_worker/fencer.py), and
        # kept (the finish, the job's state) until they are
        self.fencer = Fencer(settings.redis_url, self._copied) if self.cluster else None
        self.ending: dict[str, tuple[Ending, JobState]] = {}
        self.tokenizer = Tokenizer.from_file(os.path.join(settings.model_path, "tokenizer.json"))
        self.token_text = TokenText(self.tokenizer)
        self.feedback = feedback
        self.interval = settings.stream_interval
        self.states: dict[str, JobState] = {}
        self.metrics = Histograms()
        self.flusher = Flusher(sync_client(settings.redis_url, decode=False, timeout=HELD_TIMEOUT_S))
        self._last_flush = time.monotonic()

    def register(self, job: Register) -> None:
        try:
            self._register(job)
        except Exception as exc:  # noqa: BLE001 - the job fails alone; the lane goes on
            log.exception("job %s could not be registered", job.job_id)
            failed = self.jobs.fail(job.job_id, f"the output lane could not take the job: {exc}", job.worker,
                                    owner=job.owner)
            self.feedback.put(Abort(job.job_id, FinishReason.error))
            mine = failed is None or failed.code not in NOT_ENDED_HERE
            self.feedback.put(Done(job.job_id) if mine else Dropped(job.job_id))

    def _register(self, job: Register) -> None:
        detok = Detokenizer(self.tokenizer, list(job.stop), job.min_tokens, job.include_stop)
        if job.resume_ids:
            detok.resume(list(job.resume_ids), job.emitted)
        st = JobState(detok, job.seq, len(job.emitted.encode()), len(job.resume_ids), job.created_at or time.time(),
                      job.prompt_tokens, job.tenant, job.weight, written=len(job.resume_ids),
                      logprob_bytes=job.logprob_bytes, worker=job.worker, owner=job.owner)
        st.stages.update(tokenize_at=job.tokenize_at, tokenized_at=job.tokenized_at)
        if job.trace:
            st.trace = JobTrace(job.trace, job.job_id, job.worker, job.tokenized_at, job.admitted_at,
                                not job.started, job.prompt_tokens)
        self.states[job.job_id] = st
        if job.started:
            self.metrics.observe(QUEUE, time.time() - st.created_at)

    def flush_metrics(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_flush >= 1.0:
            self._last_flush = now
            self.flusher.flush(self.metrics)

    def handle_deltas(self, data: bytes) -> None:
        pipe, units = self.build(data)
        self.commit(pipe, units)

    def build(self, data: bytes) -> tuple[Any, list[Unit]]:
        """The step's writes (a `Deltas` batch), queued on a pipeline: per partition its prompts' logprob
        documents, one STEP_SCRIPT call for its jobs' chunks and ids, then its finishes (a `Unit` each, which
        says where its replies will be, for `settle`)."""
        step = StepWrites()
        wall = time.time()
        for row in Deltas(data).rows():
            st = self.states.get(row["job_id"])
            if st is not None and not st.ended:  # else already ended here (a stop string ended it before the engine
                self._take(row, st, step, wall)   # heard)
        for job_id in step.done:  # the engine is done with them: their slots are free while their ends are written
            self.feedback.put(Ended(job_id))
        return self._queue(step)

    def _take(self, row: dict[str, Any], st: JobState, step: StepWrites, wall: float) -> None:
        """One job's part of the step: its new text (stop strings held back), written when due, and its end."""
        job_id, ids, reason = row["job_id"], row["token_ids"], row["finish_reason"]
        flags = FRESH if st.fresh else 0
        if row["scheduled_at"]:
            st.stages["scheduled_at"] = row["scheduled_at"]
        if st.trace is not None:
            st.trace.engine_events(row["timeline"])
            if ids and not st.trace.first_token_at:  # this attempt's first (a resumed job's too)
                st.trace.first_token(wall)
        try:
            emit, hit, used = st.detok.push(ids) if ids else ("", None, 0)
        except Exception as exc:  # noqa: BLE001 - this job ends with an error, the step goes on
            log.exception("job %s: detokenizing failed", job_id)
            if reason is None:
                self.feedback.put(Abort(job_id, FinishReason.error))
            step.end(job_id, FinishReason.error, f"detokenizing failed: {exc}", st)
            return
        if ids:
            flags |= self._hold(row, ids[:used], st, emit, wall)  # (a stop string's token the last counted)
        if row["prompt_logprobs"] is not None:
            step.prompts.append((job_id, self._prompt_document(row)))
        if hit is not None:
            st.stop = hit
            if reason is None:
                self.feedback.put(Abort(job_id, FinishReason.stop))
            reason = FinishReason.stop.value
        elif reason is not None:
            held, hit = st.detok.flush()
            st.held_text += held
            if hit is not None:  # (completed by the character let out at the end)
                st.stop = hit
                reason = FinishReason.stop.value
        # Written now: the first token, the end, a fresh job's keys, else every `interval` tokens.
        if flags or reason is not None or st.n_tokens - st.written >= self.interval:
            self._write(job_id, st, flags, step)
        if reason is not None:
            step.end(job_id, FinishReason(reason), row.get("error") or "", st)
            if st.trace is not None:
                st.trace.ended(wall, FinishReason(reason).value, st.n_tokens, row.get("error") or "")
            self.metrics.observe(E2E, wall - st.created_at)
            self.metrics.inc(GENERATION_TOKENS, st.n_tokens)
            self.metrics.inc(PROMPT_TOKENS, st.prompt_tokens)
            self.metrics.inc(f"{REQUEST_SUCCESS}:{FinishReason(reason).value}")

    def _hold(self, row: dict[str, Any], ids: list[int], st: JobState, emit: str, wall: float) -> int:
        """Keep the job's new tokens `ids` (the row's, or its first ones), their text and logprob entries until
        written; FIRST_TOKEN for its first."""
        first = st.n_tokens == 0
        if first:
            self.metrics.observe(TTFT, wall - st.created_at)
        elif st.last_token_at:
            self.metrics.observe(ITL, (wall - st.last_token_at) / len(ids))
        st.last_token_at = wall
        st.held_ids += pack_ids(ids)
        st.n_tokens += len(ids)
        st.held_text += emit
        if row["logprobs"] is not None:
            st.held_logprobs += self._entries(ids, row["logprobs"], row["top_ids"], row["top_logprobs"])
        return FIRST_TOKEN if first else 0

    def _write(self, job_id: str, st: JobState, flags: int, step: StepWrites) -> None:
        """What the job holds, as its part of the step call: its ids, and its chunk as one `token` event."""
        packed, tok_off = bytes(st.held_ids), st.written * 4
        chunk, message, text_off, lp, lp_off = b"", b"", st.text_bytes, b"", st.logprob_bytes
        if st.held_text or st.held_logprobs:
            st.seq += 1
            chunk = st.held_text.encode()
            st.text_bytes += len(chunk)
            message = token_message(st.seq, st.held_text, st.held_logprobs)
            lp = b"".join(orjson.dumps(e) + b"\n" for e in st.held_logprobs)
            st.logprob_bytes += len(lp)
        if st.trace is not None:
            st.trace.writes += 1
        if flags or packed or chunk or lp:
            new = st.n_tokens - st.written
            charge = (st.tenant, new * OUTPUT_COST / st.weight, new) if st.tenant and new else ("", 0.0, 0)
            write = step_write(job_id, flags, tok_off, packed, text_off, chunk, st.seq, message, st.n_tokens, lp_off,
                               lp, st.worker, charge)
            st.history.append(write)
            step.add(job_id, write)
        st.written, st.held_ids, st.held_text, st.held_logprobs = st.n_tokens, bytearray(), "", []
        st.fresh = st.fresh and not chunk and not packed and not lp

    def _queue(self, step: StepWrites) -> tuple[Any, list[Unit]]:
        """The step's pipeline, partition by partition: the prompts' logprob documents, the step call, then the
        finishes (a job's last chunk precedes its end); a `Unit` per partition notes its calls and replies."""
        pipe = self.client.pipeline(transaction=not self.cluster)
        prompts: dict[int, list[tuple[str, bytes]]] = defaultdict(list)
        for job_id, document in step.prompts:
            prompts[names.job_partition(job_id)].append((job_id, document))
        finishes: dict[int, list[Ending]] = defaultdict(list)
        for ending in step.finishes:
            finishes[names.job_partition(ending[0])].append(ending)
        placed: list[tuple[int, int, int]] = []  # per unit: its partition, where its calls begin and end on `pipe`
        for p in dict.fromkeys([*prompts, *step.calls, *finishes]):
            begin = placed[-1][2] if placed else 0
            for job_id, document in prompts[p]:  # before the step that carries the job's first token
                pipe.set(names.prompt_logprobs_key(job_id), document, nx=True, ex=self.ttl)
            if p in step.calls:
                keys, args = step.calls[p]
                self.jobs.step(keys, args, pipe)
            for job_id, reason, error, fields, worker, owner, written in finishes[p]:
                self.jobs.finish(job_id, reason, error, fields, pipe=pipe, worker=worker, owner=owner,
                                 written=written)
            placed.append((p, begin, begin + len(prompts[p]) + (p in step.calls) + len(finishes[p])))
        calls = _queued(pipe)
        units = [Unit(p, names.partition_prefix(p), calls[begin:end], len(prompts[p]),
                      [step.jobs[p]] if p in step.calls else [], finishes[p], [e[0] for e in finishes[p]])
                 for p, begin, end in placed]
        return pipe, units

    def settle(self, unit: Unit, results: list[Any]) -> None:
        """Read a unit's replies, once it was written. A job no longer this worker's (its
        record gone, another worker's now, or not running) had nothing written, and is dropped: the engine aborts
        it, the lane forgets it, and the ledger lets it go without acknowledging its entry (`Dropped`). A job
        ending in this step is judged by its finish instead (its step, sent again after its finish went
        through, finds it ended): dropped if refused, else left in `done`, which `_written` reports as Done. A job
        whose record lacks earlier steps of this lane (a gap, or a finish still behind its step) has them written
        again (`_heal`), and fails (`_lost`) only where they are no longer kept. A job this lane already let go
        (a unit before this one, held back by an outage with it, dropped or failed it) is not judged again."""
        ending = set(unit.finishes)
        refused: dict[str, str] = {}
        lost: list[str] = []
        at = unit.first_step
        for job_ids in unit.steps:
            raw, at = results[at], at + 1
            if isinstance(raw, Exception):
                continue  # _written logs it
            for job_id, code in zip(job_ids, StepReply.parse(raw).codes):
                if job_id not in self.states:
                    continue
                if code is StepCode.gap:
                    lost.append(job_id)
                elif code in REFUSED and not (code is StepCode.ended and job_id in ending):
                    refused[job_id] = code.name
        for ending_job, raw in zip(unit.ends, results[at:]):
            job_id = ending_job[0]
            if isinstance(raw, Exception) or job_id not in self.states:
                continue
            if (end := FinishReply.parse(raw).code) is FinishCode.owner_changed:
                end = self._finish_again(ending_job)
            if end in NOT_ENDED_HERE:
                refused.setdefault(job_id, end.name)
            elif end is FinishCode.behind and job_id not in lost:
                lost.append(job_id)
        for job_id in lost:
            healed = self._heal(job_id, self.states[job_id])
            if healed is StepCode.written and job_id in ending:  # its finish found the record short: again
                end = self._finish_again(next(e for e in unit.ends if e[0] == job_id))
                if end in NOT_ENDED_HERE:
                    refused.setdefault(job_id, end.name)
                    continue
                healed = StepCode.gap if end is FinishCode.behind else healed
            if healed is StepCode.written:
                continue
            if healed in REFUSED:
                refused.setdefault(job_id, healed.name)
            elif (end := self._lost(job_id, self.states[job_id])) in NOT_ENDED_HERE:
                refused.setdefault(job_id, end.name)
            elif job_id not in ending:  # ended here, mid-run: the engine stops it, the ledger acknowledges it
                self.states.pop(job_id, None)
                self.feedback.put(Abort(job_id, FinishReason.error))
                self.feedback.put(Done(job_id))
        for job_id, why in refused.items():
            log.warning("job %s dropped: %s", job_id, why)
            self.states.pop(job_id, None)
            if job_id in ending:
                unit.done.remove(job_id)  # the engine has ended it (or was told to)
            else:
                self.feedback.put(Abort(job_id, FinishReason.error))
            self.feedback.put(Dropped(job_id))

    def _finish_again(self, ending: Ending) -> FinishCode:
        """A finish sent again (named for an owner its record no longer names, or not confirmed on a replica), the
        owner read from the record (`JobOps.finish`). How it went (its job is still in `done`, or `ending`: on a
        cluster the fencer confirms it)."""
        job_id, reason, error, fields, worker, _, written = ending

        def again() -> FinishReply | None:
            return self.jobs.finish(job_id, reason, error, fields, worker=worker, written=written)

        reply = call(again, log=log, name=f"the end of job {job_id}", on_outage=self._outage)
        return reply.code if reply is not None else FinishCode.finished

    def _heal(self, job_id: str, st: JobState) -> StepCode:
        """A job whose record lacks steps this lane wrote (a failover promoted a replica that had not received them:
        only a job's end waits for a replica) gets its last writes sent again, in order, in one step call: those
        its record has are replays (step.lua skips them), the rest are written where they belong, and published
        again (a client's relay drops a seq it has had); a part written again charges its tenant again (the failover
        that lost it lost its charge with it: the fair queue's counters lie in the job's slot). `written` when the
        record is whole again; `gap` when what it lost reaches past the writes kept (HISTORY_WRITES, or an earlier
        worker's), and the code that refused it otherwise."""
        keys, args = _history(st)
        if not keys:
            return StepCode.gap

        def again() -> Any:
            pipe = self.client.pipeline(transaction=False)
            self.jobs.step(keys, args, pipe)
            [reply] = pipe.execute(raise_on_error=False)
            if isinstance(reply, RETRYABLE):
                raise reply
            return reply

        return _healed(job_id, call(again, log=log, name=f"the output of job {job_id} again", on_outage=self._outage))

    def _lost(self, job_id: str, st: JobState) -> FinishCode:
        """A job whose record lacks steps this lane wrote: a failover promoted a replica that had not received
        them (only a job's end waits for a replica), or a write failed. Its text has lost a part: it ends as an
        error that says so (never as a success with a hole). Answers how its finish went."""
        log.error("job %s: its record lacks earlier steps of its output; it fails", job_id)
        reply = call(lambda: self.jobs.fail(job_id, LOST, st.worker, owner=st.owner), log=log,
                     name=f"the end of job {job_id}", on_outage=self._outage)
        return reply.code if reply is not None else FinishCode.finished

    def _entries(self, ids: list[int], chosen: list[float], top_ids: list[list[int]],
                 top_lps: list[list[float]]) -> list[list[Any]]:
        """Per token [id, text, logprob, [[id, text, logprob] per alternative, most likely first]], each followed by
        the token's bytes when its text is not their UTF-8 (shared/logprobs.py)."""
        return [self._entry(t, lp, [self._entry(a, alp) for a, alp in zip(ai, al)])
                for t, lp, ai, al in zip(ids, chosen, top_ids, top_lps)]

    def _entry(self, token_id: int, logprob: float | None, *top: list[Any]) -> list[Any]:
        text, raw = self.token_text(token_id)
        return [token_id, text, logprob, *top] + ([raw] if raw is not None else [])

    def _prompt_document(self, row: dict[str, Any]) -> bytes:
        """The prompt's text and its tokens' entries (the first token's logprob is null: nothing precedes it)."""
        ids = row["prompt_ids"] or []
        first = [self._entry(ids[0], None, [])] if ids else []
        entries = first + self._entries(ids[1:], row["prompt_logprobs"], row["prompt_top_ids"],
                                        row["prompt_top_logprobs"])
        return orjson.dumps({"text": self.tokenizer.decode(ids, skip_special_tokens=False), "tokens": entries})

    def commit(self, pipe: Any, units: list[Unit]) -> None:
        """Send the step's writes and read their replies. On a single Redis `pipe` runs, through outages, as one
        transaction. On a cluster each partition's unit goes to its master now, unless earlier ones of it wait in
        the backlog (it joins them); one that meets an outage waits there, and the units the backlog wrote since
        are read first."""
        if self.backlog is None:
            results = call(self._replayable(pipe, units), log=log, name="output lane write", on_outage=self._outage,
                           cap=WRITE_RETRY_CAP_S)
            if self.outage is not None:
                self.outage.value = 0.0
            at = 0
            for unit in units:
                self._written(unit, results[at:at + len(unit.calls)])
                at += len(unit.calls)
            return
        ready, written = self.backlog.hold(units)
        for unit, replies in written:
            self._written(unit, replies)
        sent, failed = send(ready, self.fast, self.down)
        if failed:
            log.warning("output writes of partitions %s met an outage; they wait, the others go on",
                        sorted({u.partition for u in failed}))
            self._outage_began()
            self.backlog.add(failed)  # (the fast client's slot map is read again off this loop once they go through)
        elif sent and self.outage is not None:  # (the worker writes: one master's outage is no reason to withhold
            self.outage.value = 0.0            # its heartbeat and have its jobs taken over)
        for unit, replies in sent:
            self._written(unit, replies)
        self.backlog.wait_room()

    def _back(self, partitions: list[int]) -> None:
        """The backlog's: partitions that met an outage have their writes through. The fast client reads the slot
        map again (a failover may have moved their slots) and tries their masters again."""
        heal(self.fast)
        for p in partitions:
            node = self.fast.get_node_from_key(names.partition_prefix(p))
            if node is not None:
                self.down.discard(node.name)

    def catch_up(self) -> None:
        """Read the units the backlog wrote since the last step (the lane's loop, between steps)."""
        if self.backlog is not None:
            for unit, replies in self.backlog.hold([])[1]:
                self._written(unit, replies)

    def _written(self, unit: Unit, results: list[Any]) -> None:
        """A unit's replies read (`settle`), and the jobs it ended reported Done: at once on a single Redis, once a
        replica has their ends on a cluster (`Fencer`). (Their slots were freed when they were built: `Ended`.)"""
        if unit.again:
            self._ended_again(unit, results)
            return
        for i, res in enumerate(results):
            if isinstance(res, Exception):
                log.warning("output write %d of partition %d failed: %s", i, unit.partition, res)
        ends = {end[0]: end for end in unit.ends}
        self.settle(unit, results)
        now = time.time()
        done = [job_id for job_id in unit.done if job_id in self.states]
        for job_id in done:
            st = self.states.pop(job_id)
            if st.trace is not None:
                st.trace.written(now)
            if self.fencer is None:
                self.feedback.put(Done(job_id))
            else:  # its entry waits for a replica to have its end
                self.ending[job_id] = (ends[job_id], st)
        if self.fencer is not None and done:
            self.fencer.submit(done)

    def _copied(self, job_ids: list[str]) -> None:
        """The fencer's: these jobs' ends are on a replica of their masters (called from its thread)."""
        for job_id in job_ids:
            self.ending.pop(job_id, None)
            self.feedback.put(Done(job_id))

    def refence(self) -> None:
        """The ends a replica did not confirm (a lagging replica, or a failover that may have promoted one without
        them): each job's last writes and its end are sent again (replays where they stood, written where they
        were lost), off this loop and after its partition's writes waiting (`_again`), then handed to the fencer
        again (`_ended_again`)."""
        if self.fencer is None or self.backlog is None:
            return
        units: list[Unit] = []
        while True:
            try:
                job_id = self.fencer.again.get_nowait()
            except queue.Empty:
                break
            if job_id in self.ending:
                units.append(self._again(job_id))
        if units:
            self.backlog.add(units)

    def _again(self, job_id: str) -> Unit:
        """A job's last writes (`_heal`'s) and its end, as its partition's next unit."""
        ending, st = self.ending[job_id]
        pipe = self.client.pipeline(transaction=False)
        keys, args = _history(st)
        if keys:
            self.jobs.step(keys, args, pipe)
        _, reason, error, fields, worker, owner, written = ending
        self.jobs.finish(job_id, reason, error, fields, pipe=pipe, worker=worker, owner=owner, written=written)
        p = names.job_partition(job_id)
        return Unit(p, names.partition_prefix(p), _queued(pipe), 0, [[job_id]] if keys else [], [ending], [job_id],
                    behind=BEHIND_REPLAYS, again=True)  # (its replies read whole by `_ended_again`)

    def _ended_again(self, unit: Unit, results: list[Any]) -> None:
        """An `_again` unit's replies: its job's end stands on its master (confirmed again by the fencer); or its
        record is no longer this worker's (dropped), or lost more than the lane keeps (it fails as incomplete), as
        `settle`'s jobs."""
        job_id = unit.done[0]
        if job_id not in self.ending:
            return
        ending, st = self.ending[job_id]
        healed = _healed(job_id, results[0]) if unit.steps else StepCode.written
        if healed in (StepCode.no_such_job, StepCode.not_owner):
            end = FinishCode[healed.name]  # (the same refusal, in the finish's terms)
        elif healed is StepCode.gap:
            end = FinishCode.behind
        elif isinstance(raw := results[-1], Exception):  # whether its end stands is not known: never Done so
            log.warning("job %s: its end could not be written again: %s", job_id, raw)
            end = FinishCode.behind
        elif (end := FinishReply.parse(raw).code) is FinishCode.owner_changed:
            end = self._finish_again(ending)
        if end is FinishCode.behind:
            end = self._lost(job_id, st)
        if end in NOT_ENDED_HERE:
            log.warning("job %s dropped: %s", job_id, end.name)
            del self.ending[job_id]
            self.feedback.put(Dropped(job_id))
        elif self.fencer is not None:
            self.fencer.submit([job_id])

    def wait_ends(self, timeout: float) -> bool:
        """Until every end this lane wrote is confirmed (or dropped), writing again those not: whether they all
        were within `timeout`."""
        deadline = time.monotonic() + timeout
        while (self.ending or self.held()) and time.monotonic() < deadline:
            self.catch_up()
            self.refence()
            time.sleep(0.01)
        self.catch_up()
        self.refence()
        return not self.ending and not self.held()

    def held(self) -> bool:
        """Whether writes wait in the backlog (or its replies, to be read)."""
        return self.backlog is not None and self.backlog.busy()

    def close(self) -> None:
        self.flusher.close()
        if self.backlog is not None:
            self.backlog.close()
            self.fast.close()
        if self.fencer is not None:
            self.fencer.close()

    def _outage(self) -> None:
        """A write failed: note since when (the worker's heartbeat is withheld past WRITE_OUTAGE_S), and let
        a cluster client rebuild its slot map before the next try."""
        self._outage_began()
        heal(self.client)

    def _outage_began(self) -> None:
        if self.outage is not None and not self.outage.value:
            self.outage.value = time.time()

    def _replayable(self, pipe: Any, units: list[Unit]) -> Callable[[], list[Any]]:
        """`pipe.execute`, retryable (a single Redis's transaction). A failed execute() empties the pipeline, so a
        retry sends the step's commands again on a new one (what stood is replayed). A finish that ran before its
        job's step (`FinishedEarly`) sends the step again (BEHIND_REPLAYS times at most); still behind after that,
        the job's record lost earlier steps, and `settle` heals the job or fails it."""
        calls = _queued(pipe)
        first = [pipe]
        replays = [0]

        def execute() -> list[Any]:
            step = first.pop() if first else self._rebuilt(calls)
            results = step.execute(raise_on_error=False)
            for res in results:
                if isinstance(res, RETRYABLE):
                    raise res
            at = 0
            for unit in units:
                replies, at = results[at:at + len(unit.calls)], at + len(unit.calls)
                if replays[0] < BEHIND_REPLAYS and behind(unit, replies):
                    replays[0] += 1  # a finish ran before its step: the whole step again, the step first
                    raise FinishedEarly("a job's end came before its last step's writes; the step is sent again")
            return results  # type: ignore[no-any-return]

        return execute

    def _rebuilt(self, calls: list[tuple[Any, dict[str, Any]]]) -> Any:
        again = self.client.pipeline(transaction=True)
        for args, options in calls:
            again.pipeline_execute_command(*args, **options)
        return again


def _history(st: JobState) -> tuple[list[str], list[Any]]:
    """A job's last writes kept (`JobState.history`), oldest first, as one step call's keys and arguments."""
    keys: list[str] = []
    args: list[Any] = []
    for k, a in st.history:
        keys += k
        args += a
    return keys, args


def _healed(job_id: str, raw: Any) -> StepCode:
    """A job's last writes sent again (`_history`), read: `written` when its record is whole again, else the code
    that refused them (`gap` for an error: refused by Redis itself, out of memory, ...: the job fails as before)."""
    if isinstance(raw, Exception):
        log.warning("job %s: its lost steps could not be written again: %s", job_id, raw)
        return StepCode.gap
    codes = StepReply.parse(raw).codes
    bad = next((c for c in codes if c not in (StepCode.written, StepCode.replayed)), None)
    if bad is None and StepCode.written in codes:
        log.warning("job %s: its record had lost steps of its output; they are written again", job_id)
    return StepCode.written if bad is None else bad


class FinishedEarly(redis.ConnectionError):
    """A finish answered `behind`: its step failed and was sent again after it (a cluster client resends a
    pipeline's failed commands one at a time), or reached a node that lacks it (a master lost after it
    answered). Retryable: the replay sends the step's commands again in order."""


def _queued(pipe: Any) -> list[tuple[Any, dict[str, Any]]]:
    """The commands queued on a pipeline, as (args, copies of their options: a cluster's pipeline pops
    what it routed by): a plain one keeps them in its command_stack, a cluster's in its execution
    strategy's queue."""
    strategy = getattr(pipe, "_execution_strategy", None)
    commands = [(c.args, c.options) for c in strategy.command_queue] if strategy is not None else pipe.command_stack
    return [(args, dict(options)) for args, options in commands]


def main(settings: Settings, inbox: Queue[LaneCommand], feedback: Queue[LaneReport],
         parent_pid: int | None = None, outage: Synchronized[float] | None = None) -> None:
    release_cpus()  # not confined to the engine's first core (gpu_worker/cpu_affinity.py)
    die_with_parent(signal.SIGTERM, parent_pid)  # an engine process killed outright takes its lane along
    tracing.setup("output-lane")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine process decides when the lane stops
    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    lane = OutputLane(settings, feedback, outage=outage)
    while True:
        lane.catch_up()  # (writes held by an outage, written since: read before the next step's)
        lane.refence()  # (while ends wait for a replica, those not confirmed are written again soon)
        try:
            msg = inbox.get(timeout=0.05 if lane.ending or lane.held() else 1.0)
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
                if not lane.wait_ends(ENDS_AT_STOP_S):  # their entries stay pending: another worker finds them ended
                    log.warning("%d ends not confirmed on a replica at exit", len(lane.ending))
                lane.flush_metrics(force=True)
                lane.close()  # (after the metrics flushes waiting)
                tracing.shutdown()
                gc.freeze()  # the process exits next: no final collections over what it made (exit_quickly)
                return
