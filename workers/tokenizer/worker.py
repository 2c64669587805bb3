"""The tokenizer pool's worker: `jobs` stream -> chat template + tokenize + the context check ->
one `tokenized` record per job (shared.schemas.encode_request) -> its tenant's queue in the fair queue
(shared/fair_queue.py), whence the inference workers take jobs fairest first. No torch here.

The same read takes the `tokenize` streams' calls (shared/tokenize_calls.py: `/tokenize`, `/detokenize`, token
counts), each answered at once with its reply key and message, then acknowledged and deleted.

The request was validated at the door; it is read here as the API wrote it (`GenerationRequest.from_wire`),
not validated again. An entry the API did not write fails its own job, with the reason, and nothing else.

An entry is acknowledged only in the same script call that queues its job, so a worker that dies
mid-batch leaves its entries pending for another worker to claim.
"""

from __future__ import annotations

import logging
import signal
import struct
import threading
import time
from typing import Any

import redis

from shared import fair_queue, names, tracing
from shared.grammar import GrammarError
from shared.heartbeat import Heartbeat, new_worker_id
from shared.job_ops import JobOps, publish_command
from shared.limits import context_problem
from shared.model_config import model_context
from shared.redis_client import sync_client, text
from shared.retry import run_loop
from shared.schemas import GenerationRequest, encode_request
from shared.settings import Settings
from shared.stream_consumer import Entry, StreamConsumer
from shared.tokenize_calls import REPLY_TTL_S, TokenizeCall, TokenizeReply
from workers.tokenizer.grammar import GrammarCompiler
from workers.tokenizer.prompt import PromptBuilder, PromptError

log = logging.getLogger("conveyor.tokenizer")


class TokenizerWorker:
    def __init__(self, settings: Settings, client: redis.Redis | None = None) -> None:
        self.settings = settings
        self.client = client or sync_client(settings.redis_url, decode=False)
        # the write that acknowledges a read is not resent by the client (though a resent one would queue
        # nothing twice): unacknowledged entries come back (_recover)
        self.writer = sync_client(settings.redis_url, decode=False, retries=0)
        self.worker_id = new_worker_id(names.TOKENIZER_POOL)
        self.consumer = StreamConsumer(self.client, names.streams(names.JOBS) + names.streams(names.TOKENIZE),
                                       names.TOKENIZER_GROUP, self.worker_id, names.TOKENIZER_POOL,
                                       settings.claim_idle_ms, settings.delivery_limit)
        self.jobs = JobOps(self.client, settings.job_ttl_s)
        self.prompts = PromptBuilder(settings.model_path, settings.tool_chat_template)
        self.context = model_context(settings.model_path, settings.max_model_len)
        self.stop_event = threading.Event()
        self.counters = {"processed": 0, "failed": 0, "batches": 0, "calls": 0}
        self._compiler: GrammarCompiler | None = None
        self.next_claim = 0.0

    def run(self) -> None:
        self.consumer.ensure_group()
        hb = Heartbeat(self.client, names.TOKENIZER_POOL, self.worker_id, self.settings.heartbeat_s,
                       lambda: dict(self.counters))
        hb.start()
        if self.settings.grammar_warm:  # its child starts (~2 s until it is forked) beside this loop
            threading.Thread(target=self._grammars().warm, name="grammar-warm", daemon=True).start()
        log.info("tokenizer worker %s ready (context %d tokens)", self.worker_id, self.context)
        try:
            run_loop(self.step, self.stop_event, log, "tokenizer", on_outage=self.consumer.note_outage)
        finally:
            hb.stop()
            if self._compiler is not None:
                self._compiler.close()
            log.info("tokenizer worker %s stopped", self.worker_id)

    def step(self) -> None:
        """Take over what dead workers left (now and then), then tokenize one read's entries."""
        if time.monotonic() >= self.next_claim:
            self._recover()
            self.next_claim = time.monotonic() + max(1.0, self.settings.claim_idle_ms / 4000)
        entries = self.consumer.read(self.settings.tokenizer_batch, block_ms=500)
        if entries:
            self.process(entries)

    def _recover(self) -> None:
        """Entries a dead worker left, and this worker's own that a Redis outage cut off mid-batch
        (a read entry stays pending until acknowledged; nothing is held here between reads): each is
        tokenized alone, so a job that kills its worker takes no batch-mate with it and alone reaches
        the dead-letter stream."""
        while True:
            keep, dead = self.consumer.claim_stale(self.settings.tokenizer_batch)
            own, own_dead = self.consumer.retry_own(self.settings.claim_idle_ms, self.settings.tokenizer_batch)
            keep, dead = keep + own, dead + own_dead
            self._fail_dead(dead)
            for entry in keep:
                self.process([entry])
            if not keep and not dead:
                return

    def _fail_dead(self, dead: list[Entry]) -> None:
        for entry in dead:
            job_id = _field(entry.fields, "job_id")
            if job_id:
                self.jobs.fail(job_id, "the job could not be tokenized: its message failed "
                                       f"{entry.deliveries} times and was moved to the dead-letter stream")

    def process(self, entries: list[Entry]) -> None:
        """Tokenize a read's entries, partition by partition (each partition's jobs queue in its own fair queue)."""
        by_partition: dict[str, list[Entry]] = {}
        for entry in entries:
            by_partition.setdefault(entry.stream, []).append(entry)
        for stream, group in by_partition.items():
            if names.stream_kind(stream) == names.TOKENIZE:
                self._answer(stream, group)
            else:
                self._process(stream, group)

    def _answer(self, stream: str, entries: list[Entry]) -> None:
        """Answer one partition's tokenize calls (those whose caller still waits), then acknowledge and delete
        them: a call is answered at most once more after a crash, which its caller reads the same."""
        pipe = self.client.pipeline(transaction=False)
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
        """A call's answer; what it holds that cannot be answered is an error reply, never raised."""
        try:
            if call.kind == "detokenize":
                return TokenizeReply(prompt=self.prompts.decode(call.tokens or []))
            if call.kind == "stop_sequence":
                return TokenizeReply(stop_sequence=self._stop_of(call))
            source = call.prompt or "" if call.messages is None else self.prompts.chat(
                call.messages, call.add_generation_prompt, call.tools)
            ids = self.prompts.encode(source, call.add_special_tokens)
            strs = self.prompts.token_strs(ids) if call.return_token_strs else None
            return TokenizeReply(tokens=ids, token_strs=strs)
        except PromptError as exc:
            return TokenizeReply(error=str(exc), param="tokens" if call.kind == "detokenize" else "messages")
        except Exception as exc:  # noqa: BLE001 - one call's failure is that call's alone
            log.exception("a tokenize call failed")
            return TokenizeReply(error=f"the call could not be answered ({type(exc).__name__})")

    def _stop_of(self, call: TokenizeCall) -> str | None:
        """Which stop string followed the job's text in its generated ids (None: it ended otherwise)."""
        raw = self.client.get(names.tokens_key(call.job_id or "?"))
        if not raw or not call.stops:
            return None
        data = raw if isinstance(raw, bytes) else str(raw).encode("latin-1")
        ids = list(struct.unpack(f"<{len(data) // 4}i", data[:len(data) // 4 * 4]))
        full = self.prompts.decode(ids, skip_special_tokens=True)
        at = len(call.text or "")
        return next((s for s in call.stops if full.startswith(s, at)), None)

    def _process(self, stream: str, entries: list[Entry]) -> None:
        """Tokenize one partition's entries (their texts in one call) and queue each job's record in the
        partition's fair queue. A job that cannot be tokenized fails alone, with its reason; nothing a
        request holds can stop this loop."""
        job_ids = [_field(e.fields, "job_id") for e in entries]
        pipe = self.client.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hmget(names.job_key(job_id or "?"), "status", "cancel_requested", "trace", "created_at")
        states = pipe.execute()
        started = time.time()
        prepared: list[tuple[str, GenerationRequest, str | None]] = []  # (job, request, prompt text or None: ids)
        traces: dict[str, tuple[str, float]] = {}  # traced jobs: (carrier, created_at)
        for entry, job_id, (status, cancel, trace, created) in zip(entries, job_ids, states):
            if not job_id or status != b"queued" or cancel == b"1":
                continue  # cancelled, expired or already taken further: nothing to do
            if trace:
                traces[job_id] = (trace.decode(), float(created or started))
            ready = self._prepare(job_id, entry)
            if ready is not None:
                prepared.append((job_id, *ready))
        texts = [(p, req.prompt is not None) for _, req, p in prepared if p is not None]
        encoded = iter(self._encode([t for t, _ in texts], [raw for _, raw in texts]) if texts else [])
        ids = [req.prompt_token_ids if p is None else next(encoded) for _, req, p in prepared]
        now = time.time()
        queued = [q for (job_id, req, _), prompt_ids in zip(prepared, ids)
                  if (q := self._record(job_id, req, prompt_ids, traces.get(job_id, ("",))[0], (started, now)))
                  is not None]
        fair_queue.push(self.writer, names.stream_partition(stream), [e.id for e in entries], queued,
                        self.settings.fair_share, self.settings.job_ttl_s)
        self.counters["processed"] += len(queued)
        self.counters["batches"] += 1
        self._trace(traces, prepared, ids, started, now)

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

    def _prepare(self, job_id: str, entry: Entry) -> tuple[GenerationRequest, str | None] | None:
        """The job's request and its prompt text (None: given as token ids), its grammar compiled; None when
        the job failed instead."""
        try:
            req = GenerationRequest.from_wire(_field(entry.fields, "request") or "")
            prompt = None if req.prompt_token_ids is not None else self.prompts.render(req)
            if req.grammar is not None:
                self._grammars().prepare(req.grammar.spec)
            return req, prompt
        except GrammarError as exc:
            self._fail(job_id, f"invalid grammar: {exc}")
        except ValueError as exc:  # not a request the API writes (PromptError too: the template refused it)
            self._fail(job_id, f"invalid request: {exc}")
        except Exception as exc:  # noqa: BLE001 - one job's failure is that job's alone
            log.exception("job %s could not be prepared", job_id)
            self._fail(job_id, f"the request could not be tokenized ({type(exc).__name__})")
        return None

    def _record(self, job_id: str, req: GenerationRequest, prompt_ids: list[int] | None, trace: str = "",
                times: tuple[float, float] = (0.0, 0.0)) -> tuple[str, int, int, bytes] | None:
        """What the fair queue takes for the job: (job id, priority, prompt tokens, its `tokenized` record);
        None when its prompt cannot run in the context, or a value cannot travel (the job fails)."""
        if prompt_ids is None:
            self._fail(job_id, "the prompt could not be tokenized")
            return None
        try:
            problem = context_problem(len(prompt_ids), req.max_tokens, self.context)
            if problem is None:
                request = req.tokenized(job_id, prompt_ids)
                request.trace, (request.tokenize_at, request.tokenized_at) = trace, times
                return job_id, int(request.priority), len(prompt_ids), encode_request(request)
        except (ArithmeticError, TypeError, ValueError) as exc:  # a value of the wrong type or out of range
            problem = f"invalid request: {exc}"
        self._fail(job_id, problem)
        return None

    def _grammars(self) -> GrammarCompiler:
        """The grammar compiler (workers/tokenizer/grammar.py), made when the first grammar arrives."""
        if self._compiler is None:
            self._compiler = GrammarCompiler(self.settings.model_path, self.client, self.settings.job_ttl_s)
        return self._compiler

    def _encode(self, texts: list[str], raw: list[bool]) -> list[list[int] | None]:
        """Token ids per text; when the batch call fails, text by text, failing the culprits (None)."""
        try:
            return list(self.prompts.encode_batch(texts, raw))
        except Exception:  # noqa: BLE001
            log.exception("batch encode failed; encoding one by one")
        out: list[list[int] | None] = []
        for one, r in zip(texts, raw):
            try:
                out.append(self.prompts.encode_batch([one], [r])[0])
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
