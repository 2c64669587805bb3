"""The tokenizer pool's worker: `jobs` stream -> chat template + tokenize + the context check ->
one `tokenized` record per job (shared.schemas.encode_request) -> its tenant's queue in its model's fair queue
(shared/fair_queue.py), whence that model's inference workers take jobs fairest first. No torch here.

Every served model (MODELS, shared/served.py) has its tokenizer, chat template, context and grammar compiler here
(`ModelTokens`), picked by the job's record (`base_model`; none: the default model).

The same read takes the `tokenize` streams' calls (shared/tokenize_calls.py: `/tokenize`, `/detokenize`, token
counts), each answered at once with its reply key and message, then acknowledged and deleted.

The request was validated at the door; it is read here as the API wrote it (`GenerationRequest.from_wire`),
not validated again. An entry the API did not write fails its own job, with the reason, and nothing else.

An entry is acknowledged only in the same script call that queues its job, so a worker that dies
mid-batch leaves its entries pending for another worker to claim.

A job with a grammar (structured output, tools) is compiled and queued by the worker's compile lane, a thread beside
the loop: a compile takes up to seconds, and the jobs read meanwhile, of every tenant and model, go on.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis

from shared import fair_queue, names, tracing
from shared.grammar import GrammarError
from shared.heartbeat import Heartbeat, new_worker_id
from shared.job_ops import JobOps, publish_command
from shared.limits import context_problem, fitted_max_tokens
from shared.masters import REDIRECTED, fail_fast
from shared.model_config import model_context
from shared.redis_client import RETRYABLE, sync_client, text
from shared.retry import run_loop
from shared.schemas import GenerationRequest, encode_request
from shared.settings import Settings
from shared.stream_consumer import Entry, Ref, StreamConsumer
from shared.tokenize_calls import MAX_CALL_TOKENS, REPLY_TTL_S, TokenizeCall, TokenizeReply
from workers.tokenizer.grammar import COMPILE_TIMEOUT_S, GrammarCompiler
from workers.tokenizer.prompt import PromptBuilder, PromptError

log = logging.getLogger("conveyor.tokenizer")

SHAPED_WAITING = 8  # reads' batches of jobs with a grammar waiting for the compile lane
# entries of jobs with a grammar kept waiting for room in the lane (`overflow`); past it the loop waits for room: a
# worker does not hoard more than this of the pool's structured jobs, which the pool's other workers may read
OVERFLOW_MAX = 256
# a read's jobs with a grammar, for the compile lane: (stream, model, [(entry, job id, request, prompt text)],
# traced jobs' (carrier, created at), when the read's tokenizing started)
Shaped = tuple[str, "ModelTokens", list[tuple[Entry, str, GenerationRequest, str | None]],
               dict[str, tuple[str, float]], float]


@dataclass
class ModelTokens:
    """One served model's tokenizing: its prompt builder (tokenizer and chat template), its context, and its
    grammar compiler, made when its first grammar arrives (a grammar is compiled for one vocabulary)."""
    key: str  # its queue name ('' the default model)
    path: str
    prompts: PromptBuilder
    context: int
    compiler: GrammarCompiler | None = None

    @classmethod
    def load(cls, key: str, path: str, settings: Settings) -> ModelTokens:
        return cls(key, path, PromptBuilder(path, settings.tool_chat_template),
                   model_context(path, settings.max_model_len))


class TokenizerWorker:
    def __init__(self, settings: Settings, client: redis.Redis | None = None) -> None:
        self.settings = settings
        self.client = client or sync_client(settings.redis_url, decode=False)
        # (a cluster's) a client that does not retry and waits briefly: a read's jobs are looked up and queued with
        # it, so a master that stops answering holds its own partition's entries (`held`), not the others'
        self.fast = fail_fast(settings.redis_url)
        # the write that acknowledges a read is not resent by the client (though a resent one would queue
        # nothing twice): unacknowledged entries come back (_recover, `held`)
        self.writer = self.fast or sync_client(settings.redis_url, decode=False, retries=0)
        self.worker_id = new_worker_id(names.TOKENIZER_POOL)
        self.consumer = StreamConsumer(self.client, names.streams(names.JOBS) + names.streams(names.TOKENIZE),
                                       names.TOKENIZER_GROUP, self.worker_id, names.TOKENIZER_POOL,
                                       settings.claim_idle_ms, settings.delivery_limit, fast=self.fast)
        self.consumer.on_dead = self._fail_dead  # the job fails before its entry is dead-lettered
        self.jobs = JobOps(self.client, settings.job_ttl_s)
        self.models = {settings.key_of(m.name): ModelTokens.load(settings.key_of(m.name), m.path, settings)
                       for m in settings.served.values()}
        self.prompts = self.models[""].prompts  # the default model's
        self.stop_event = threading.Event()
        self.counters = {"processed": 0, "failed": 0, "batches": 0, "calls": 0}
        self.next_claim = 0.0
        # (a cluster's) entries read whose partition's master did not answer when they were to be queued: tokenized
        # again once it answers (pending here meanwhile; another worker claims them if this one dies)
        self.held: dict[Ref, Entry] = {}
        # the jobs with a grammar, a read's batch at a time, for the compile lane (`run` starts it; without it, as a
        # library, `process` compiles in place); bounded: past it a read's jobs with a grammar wait in `overflow`
        self._shaped: queue.Queue[Shaped | None] = queue.Queue(maxsize=SHAPED_WAITING)
        self._lane: threading.Thread | None = None
        # the entries handed to it, and those in `overflow`, kept from going idle meanwhile (`step`)
        self._in_lane: set[Ref] = set()
        # entries of jobs with a grammar read while the lane was full: pending here, their jobs prepared again once
        # it has room (an entry is small; what it names stays in Redis), while the loop reads and queues the rest
        self.overflow: dict[Ref, Entry] = {}
        self._in_lane_lock = threading.Lock()
        self._compilers_lock = threading.Lock()

    def run(self) -> None:
        self.consumer.ensure_group()
        hb = Heartbeat(self.client, names.TOKENIZER_POOL, self.worker_id, self.settings.heartbeat_s,
                       lambda: dict(self.counters))
        hb.start()
        if self.settings.grammar_warm:  # its child starts (~2 s until it is forked) beside this loop
            threading.Thread(target=self._grammars(self.models[""]).warm, name="grammar-warm", daemon=True).start()
        self._lane = threading.Thread(target=self._compile_lane, name="grammar-compile", daemon=True)
        self._lane.start()
        log.info("tokenizer worker %s ready (%s)", self.worker_id,
                 ", ".join(f"{m.path}: context {m.context} tokens" for m in self.models.values()))
        try:
            run_loop(self.step, self.stop_event, log, "tokenizer", on_outage=self.consumer.note_outage)
        finally:
            if self.overflow:  # for the pool's other workers at once (their delivery counted once more, as any)
                with contextlib.suppress(*RETRYABLE):
                    self.consumer.hand_back(list(self.overflow), self.settings.claim_idle_ms)
            self._shaped.put(None)  # the lane ends once the compiles handed to it are done
            self._lane.join(COMPILE_TIMEOUT_S * (SHAPED_WAITING + 1))
            hb.stop()
            for m in self.models.values():
                if m.compiler is not None:
                    m.compiler.close()
            log.info("tokenizer worker %s stopped", self.worker_id)

    def step(self) -> None:
        """Take over what dead workers left (now and then), then tokenize one read's entries (and those held for
        their master, once it answers)."""
        if time.monotonic() >= self.next_claim:
            with self._in_lane_lock:
                in_lane = list(self._in_lane)
            if in_lane:  # still compiling (or waiting to): not left for a retry here, nor taken by another worker
                self.consumer.refresh(in_lane)
            self._recover()
            self.next_claim = time.monotonic() + max(1.0, self.settings.claim_idle_ms / 4000)
        # (a read whose reply was lost: its entries held before anything else can fail this step)
        self.held.update((e.ref, e) for e in self.consumer.lost(known=self.held.keys() | self.overflow.keys()))
        if self.overflow and not self._shaped.full():  # the lane has room: the oldest waiting, a read's worth
            again = list(self.overflow.values())[:self.settings.tokenizer_batch]
            for entry in again:
                del self.overflow[entry.ref]
            with self._in_lane_lock:
                self._in_lane.difference_update(e.ref for e in again)
            self.process(again)
        held = [e for e in self.held.values() if not self.consumer.masters.is_down(e.stream)]
        entries = self.consumer.read(self.settings.tokenizer_batch, block_ms=100 if self.held else 500)
        if held or entries:
            self.process(held + entries)

    def _recover(self) -> None:
        """Entries a dead worker left, and this worker's own that a Redis outage cut off mid-batch
        (a read entry stays pending until acknowledged; nothing is held here between reads): each is
        tokenized alone, so a job that kills its worker takes no batch-mate with it and alone reaches
        the dead-letter stream."""
        while True:
            keep, dead = self.consumer.claim_stale(self.settings.tokenizer_batch)
            own, own_dead = self.consumer.retry_own(self.settings.claim_idle_ms, self.settings.tokenizer_batch)
            keep, dead = keep + own, dead + own_dead
            for entry in keep:
                self.held.pop(entry.ref, None)  # (held past the claim deadline: taken up here)
                if self.overflow.pop(entry.ref, None) is not None:
                    with self._in_lane_lock:
                        self._in_lane.discard(entry.ref)
                self.process([entry])
            if not keep and not dead:
                return

    def _fail_dead(self, entry: Entry) -> None:
        job_id = _field(entry.fields, "job_id")
        if job_id:
            self.jobs.fail(job_id, "the job could not be tokenized: its message failed "
                                   f"{entry.deliveries} times and was moved to the dead-letter stream")

    def process(self, entries: list[Entry]) -> None:
        """Tokenize a read's entries, partition by partition (each partition's jobs queue in its own fair queue).
        On a cluster, a partition whose master does not answer has its entries held (`held`) until it does, and
        the others go on (the read itself fails when no master answers)."""
        by_partition: dict[str, list[Entry]] = {}
        for entry in entries:
            by_partition.setdefault(entry.stream, []).append(entry)
        for stream, group in by_partition.items():
            if self.consumer.masters.is_down(stream):  # (found so meanwhile: not waited on again)
                self.held.update((e.ref, e) for e in group)
                continue
            try:
                if names.stream_kind(stream) == names.TOKENIZE:
                    self._answer(stream, group)
                else:
                    self._process(stream, group)
            except (*RETRYABLE, *REDIRECTED) as exc:
                if not self.consumer.cluster:
                    raise
                self.consumer.masters.failed_key(stream, exc)
                if any(e.ref not in self.held for e in group):
                    log.warning("%d entries of %s held until its master answers: %s", len(group), stream, exc)
                self.held.update((e.ref, e) for e in group)
                continue
            for entry in group:
                self.held.pop(entry.ref, None)

    def _answer(self, stream: str, entries: list[Entry]) -> None:
        """Answer one partition's tokenize calls (those whose caller still waits), then acknowledge and delete
        them: a call is answered at most once more after a crash, which its caller reads the same."""
        pipe = self.consumer.masters.pipeline(stream)  # (its calls' keys are in its slot)
        publish = publish_command(self.client)
        for entry in entries:
            call_id = _field(entry.fields, "call_id") or ""
            if not call_id.startswith("tok_"):
                continue
            try:
                call = TokenizeCall.from_wire(_field(entry.fields, "call") or "")
            except ValueError as exc:
                reply = TokenizeReply(error=str(exc))
            else:
                if call.expired:
                    continue
                reply = self._reply(call)
            data = reply.to_wire()
            pipe.set(names.tokenize_reply_key(call_id), data, ex=REPLY_TTL_S)
            pipe.execute_command(publish, names.job_channel(call_id), data)
        ids = [e.id for e in entries]
        pipe.xack(stream, names.TOKENIZER_GROUP, *ids)
        pipe.xdel(stream, *ids)
        pipe.execute()
        self.counters["calls"] += len(entries)

    def _reply(self, call: TokenizeCall) -> TokenizeReply:
        """A call's answer, with its model's tokenizer; what it holds that cannot be answered is an error reply,
        never raised."""
        served = self.models.get(call.base_model or "")
        if served is None:
            return TokenizeReply(error=f"the model {call.base_model!r} is not served", param="model")
        prompts = served.prompts
        try:
            if call.kind == "detokenize":
                return TokenizeReply(prompt=prompts.decode(call.tokens or []))
            if call.messages is None:
                source = call.prompt or ""
            elif call.continue_final_message:
                source = prompts.continued(call.messages, call.tools)
            else:
                source = prompts.chat(call.messages, call.add_generation_prompt, call.tools)
            ids = prompts.encode(source, call.add_special_tokens)
            if len(ids) > MAX_CALL_TOKENS:
                return TokenizeReply(error=f"the prompt is {len(ids)} tokens; a tokenize call answers at most "
                                           f"{MAX_CALL_TOKENS}", param="messages" if call.messages else "prompt")
            strs = prompts.token_strs(ids) if call.return_token_strs else None
            return TokenizeReply(tokens=ids, token_strs=strs)
        except PromptError as exc:
            return TokenizeReply(error=str(exc), param="tokens" if call.kind == "detokenize" else "messages")
        except Exception as exc:  # noqa: BLE001 - one call's failure is that call's alone
            log.exception("a tokenize call failed")
            return TokenizeReply(error=f"the call could not be answered ({type(exc).__name__})")

    def _process(self, stream: str, entries: list[Entry]) -> None:
        """Tokenize one partition's entries, model by model (the record's `base_model`), and queue each job in
        its model's fair queue of the partition. A job for a model not served here fails alone."""
        partition = names.stream_partition(stream)
        # (an entry naming a job of another partition is damaged: no such job here, acknowledged)
        job_ids = [j if j and names.job_partition(j) == partition else None
                   for j in (_field(e.fields, "job_id") for e in entries)]
        pipe = self.consumer.masters.pipeline(stream)  # (its jobs' keys are in its slot)
        for job_id in job_ids:
            if job_id:
                pipe.hmget(names.job_key(job_id), "status", "cancel_requested", "trace", "created_at", "base_model")
        states = iter(pipe.execute() if pipe.command_stack else [])
        by_model: dict[str, list[tuple[Entry, str | None, list[Any]]]] = {}
        for entry, job_id in zip(entries, job_ids):
            state = next(states) if job_id else [None] * 5
            by_model.setdefault(text(state[4]), []).append((entry, job_id, state[:4]))
        for key, group in by_model.items():
            served = self.models.get(key)
            if served is None:  # a record naming a model this deployment no longer serves: acknowledged, not queued
                for _, job_id, (status, *_) in group:
                    if job_id and status == b"queued":
                        self._fail(job_id, f"the model {key!r} is not served")
                fair_queue.push(self.writer, names.stream_partition(stream), [e.id for e, _, _ in group], [])
                continue
            self._tokenize(stream, served, group)

    def _tokenize(self, stream: str, served: ModelTokens, group: list[tuple[Entry, str | None, list[Any]]]) -> None:
        """Tokenize one partition's entries of one model (their texts in one call) and queue each job's record in
        the model's fair queue: the jobs without a grammar first, then those whose grammar had to be compiled (a
        compile takes up to seconds: their batch-mates do not wait for it). A job that cannot be tokenized fails
        alone, with its reason; nothing a request holds can stop this loop."""
        started = time.time()
        prepared: list[tuple[Entry, str, GenerationRequest, str | None]] = []  # (entry, job, request, prompt text)
        traces: dict[str, tuple[str, float]] = {}  # traced jobs: (carrier, created_at)
        for entry, job_id, (status, cancel, trace, created) in group:
            if not job_id or status != b"queued" or cancel == b"1":
                continue  # cancelled, expired or already taken further: nothing to do
            if trace:
                traces[job_id] = (trace.decode(), float(created or started))
            ready = self._prepare(job_id, entry, served)
            if ready is not None:
                prepared.append((entry, job_id, *ready))
        shaped = [p for p in prepared if p[2].grammar is not None]
        waiting = {p[0].id for p in shaped}
        acked = [e.id for e, _, _ in group if e.id not in waiting]
        if acked:
            self._queue(stream, served, acked, [p for p in prepared if p[2].grammar is None], traces, started)
        if shaped and self._lane is not None:
            with self._in_lane_lock:
                self._in_lane.update(p[0].ref for p in shaped)
            try:
                self._shaped.put_nowait((stream, served, shaped, traces, started))  # the loop reads on meanwhile
            except queue.Full:
                if len(self.overflow) < OVERFLOW_MAX:  # (not waited for: the other jobs of every client go on)
                    self.overflow.update((p[0].ref, p[0]) for p in shaped)
                else:
                    self._shaped.put((stream, served, shaped, traces, started))
        elif shaped:
            self._compile_queue((stream, served, shaped, traces, started))

    def _compile_lane(self) -> None:
        """The jobs with a grammar, compiled and queued beside the loop: a compile takes up to COMPILE_TIMEOUT_S (the
        first of a worker more: xgrammar loads), and the jobs read meanwhile, of every tenant and model, do not wait
        for it. A batch that meets an outage stays pending (`_recover` takes it up again)."""
        while (shaped := self._shaped.get()) is not None:
            try:
                self._compile_queue(shaped)
            except RETRYABLE as exc:
                log.warning("jobs with a grammar left pending for a retry: %s", exc)
            except Exception:  # noqa: BLE001 - the lane outlives any batch's trouble; its entries stay pending
                log.exception("jobs with a grammar could not be queued; left pending for a retry")
            finally:
                with self._in_lane_lock:
                    self._in_lane.difference_update(p[0].ref for p in shaped[2])

    def _compile_queue(self, shaped: Shaped) -> None:
        stream, served, prepared, traces, started = shaped
        compiled = [p for p in prepared if self._compile(p[1], p[2], served)]
        self._queue(stream, served, [p[0].id for p in prepared], compiled, traces, started)

    def _queue(self, stream: str, served: ModelTokens, acked: list[str],
               prepared: list[tuple[Entry, str, GenerationRequest, str | None]],
               traces: dict[str, tuple[str, float]], started: float) -> None:
        """The prepared jobs' texts tokenized together, their records pushed to the fair queue with `acked` (the
        entries done with) acknowledged in the same step."""
        texts = [(p, req.prompt is not None) for _, _, req, p in prepared if p is not None]
        encoded = iter(self._encode(served.prompts, [t for t, _ in texts], [raw for _, raw in texts]) if texts else [])
        ids = [req.prompt_token_ids if p is None else next(encoded) for _, _, req, p in prepared]
        ids = [self._fit(served, req, i) for (_, _, req, _), i in zip(prepared, ids)]
        now = time.time()
        queued = [q for (_, job_id, req, _), prompt_ids in zip(prepared, ids)
                  if (q := self._record(job_id, req, prompt_ids, served.context, traces.get(job_id, ("",))[0],
                                        (started, now))) is not None]
        fair_queue.push(self.writer, names.stream_partition(stream), acked, queued,
                        self.settings.fair_share, self.settings.job_ttl_s, served.key)
        self.counters["processed"] += len(queued)
        self.counters["batches"] += 1
        self._trace({j: t for j, t in traces.items() if any(p[1] == j for p in prepared)},
                    [(job_id, req, p) for _, job_id, req, p in prepared], ids, started, now)

    def _trace(self, traces: dict[str, tuple[str, float]], prepared: list[tuple[str, GenerationRequest, str | None]],
               ids: list[list[int] | None], started: float, done: float) -> None:
        """The traced jobs' spans here, once they are queued on: the wait in `jobs`, and the tokenizing (the
        read's texts were tokenized together: each job's span is the read's)."""
        if not traces:
            return
        tokens = {job_id: len(p) for (job_id, _, _), p in zip(prepared, ids) if p is not None}
        for job_id, (trace, created) in traces.items():
            attrs = {"conveyor.job.id": job_id, "conveyor.worker": self.worker_id}
            tracing.record("conveyor.queue.jobs", trace, created, started, attrs)
            tracing.record("conveyor.tokenize", trace, started, done,
                           {**attrs, "gen_ai.usage.input_tokens": tokens.get(job_id), "conveyor.batch.jobs":
                            len(prepared)})

    def _prepare(self, job_id: str, entry: Entry, served: ModelTokens) -> tuple[GenerationRequest, str | None] | None:
        """The job's request and its prompt text (None: given as token ids); None when the job failed instead."""
        try:
            req = GenerationRequest.from_wire(_field(entry.fields, "request") or "")
            return req, None if req.prompt_token_ids is not None else served.prompts.render(req)
        except RETRYABLE:
            raise  # (its partition's master does not answer: its entries are held, `process`)
        except ValueError as exc:  # not a request the API writes (PromptError too: the template refused it)
            self._fail(job_id, f"invalid request: {exc}")
        except Exception as exc:  # noqa: BLE001 - one job's failure is that job's alone
            log.exception("job %s could not be prepared", job_id)
            self._fail(job_id, f"the request could not be tokenized ({type(exc).__name__})")
        return None

    def _compile(self, job_id: str, req: GenerationRequest, served: ModelTokens) -> bool:
        """The job's grammar compiled for its model and stored for the inference workers; False when the job
        failed instead."""
        assert req.grammar is not None
        try:
            self._grammars(served).prepare(req.grammar.spec, names.job_partition(job_id))
            return True
        except RETRYABLE:
            raise
        except GrammarError as exc:
            self._fail(job_id, f"invalid grammar: {exc}")
        except Exception as exc:  # noqa: BLE001 - one job's failure is that job's alone
            log.exception("job %s: its grammar could not be compiled", job_id)
            self._fail(job_id, f"the grammar could not be compiled ({type(exc).__name__})")
        return False

    def _record(self, job_id: str, req: GenerationRequest, prompt_ids: list[int] | None, context: int,
                trace: str = "", times: tuple[float, float] = (0.0, 0.0)) -> tuple[str, int, int, bytes] | None:
        """What the fair queue takes for the job: (job id, priority, prompt tokens, its `tokenized` record);
        None when its prompt cannot run in its model's `context`, or a value cannot travel (the job fails)."""
        if prompt_ids is None:
            self._fail(job_id, "the prompt could not be tokenized")
            return None
        try:
            if req.max_tokens_defaulted:  # left out: what the context leaves, up to the default
                req.max_tokens = fitted_max_tokens(len(prompt_ids), req.max_tokens, req.min_tokens, context)
            problem = context_problem(len(prompt_ids), req.max_tokens, context)
            if problem is None:
                request = req.tokenized(job_id, prompt_ids)
                request.trace, (request.tokenize_at, request.tokenized_at) = trace, times
                return job_id, int(request.priority), len(prompt_ids), encode_request(request)
        except (ArithmeticError, TypeError, ValueError) as exc:  # a value of the wrong type or out of range
            problem = f"invalid request: {exc}"
        self._fail(job_id, problem)
        return None

    @staticmethod
    def _fit(served: ModelTokens, req: GenerationRequest, ids: list[int] | None) -> list[int] | None:
        """`truncation: auto`: a prompt over its model's context without its oldest turns (after the leading system
        messages, never the last; a tool result never without its call), the fewest that fit, found in a binary
        search (a few renders). As it is when it fits, or when nothing dropped makes it fit (the job then fails)."""
        if ids is None or req.truncation != "auto" or not req.messages or len(ids) + req.max_tokens <= served.context:
            return ids
        turns = req.messages
        lead = next((i for i, m in enumerate(turns) if m.role != "system"), len(turns))

        def without(k: int) -> list[int] | None:  # the prompt with the k oldest turns dropped (None: not rendered)
            start = lead + k
            while start < len(turns) - 1 and turns[start].role == "tool":
                start += 1
            try:
                text = served.prompts.render(req.model_copy(update={"messages": turns[:lead] + turns[start:]}))
                return served.prompts.encode_batch([text], [False])[0]
            except Exception:  # noqa: BLE001 - a template that refuses what is left: not a fit
                return None

        low, high, best = 1, len(turns) - lead - 1, None
        while low <= high:
            mid = (low + high) // 2
            got = without(mid)
            if got is not None and len(got) + req.max_tokens <= served.context:
                best, high = got, mid - 1
            else:
                low = mid + 1
        return best if best is not None else ids

    def _grammars(self, served: ModelTokens) -> GrammarCompiler:
        """A model's grammar compiler (workers/tokenizer/grammar.py), made when its first grammar arrives (by the
        compile lane, or the warm-up thread: one of them)."""
        with self._compilers_lock:
            if served.compiler is None:
                served.compiler = GrammarCompiler(served.path, self.fast or self.client, self.settings.job_ttl_s,
                                                  model=served.key)
            return served.compiler

    @staticmethod
    def _encode(prompts: PromptBuilder, texts: list[str], raw: list[bool]) -> list[list[int] | None]:
        """Token ids per text; when the batch call fails, text by text, failing the culprits (None)."""
        try:
            return list(prompts.encode_batch(texts, raw))
        except Exception:  # noqa: BLE001
            log.exception("batch encode failed; encoding one by one")
        out: list[list[int] | None] = []
        for one, r in zip(texts, raw):
            try:
                out.append(prompts.encode_batch([one], [r])[0])
            except Exception:  # noqa: BLE001
                out.append(None)
        return out

    def _fail(self, job_id: str, error: str) -> None:
        self.counters["failed"] += 1
        self.jobs.fail(job_id, error)


def _field(fields: dict[Any, Any], name: str) -> str | None:
    """A stream entry's field as text, None when the entry has no such field."""
    v = fields.get(name.encode(), fields.get(name))
    return None if v is None else text(v)


def main(settings: Settings) -> int:
    settings.require_model(weights=False)
    tracing.setup("tokenizer")
    worker = TokenizerWorker(settings)

    def _stop(signum: int, _frame: Any) -> None:
        log.info("signal %d: finishing the current batch and stopping", signum)
        worker.stop_event.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        worker.run()
    finally:
        tracing.shutdown()
    return 0
