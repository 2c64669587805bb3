"""The tokenizer pool's worker: `jobs` stream -> chat template + tokenize + validate ->
one Arrow row per job -> its tenant's queue in the fair queue (shared/fair_queue.py), whence the
inference workers take jobs fairest first. No torch here.

An entry is acknowledged only in the same script call that queues its job, so a worker that dies
mid-batch leaves its entries pending for another worker to claim.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

import pyarrow as pa
import redis
from pydantic import ValidationError

from shared import fair_queue, names
from shared.grammar import GrammarError
from shared.heartbeat import Heartbeat, new_worker_id
from shared.job_ops import JobOps
from shared.model_config import model_context
from shared.redis_client import sync_client, text
from shared.retry import run_loop
from shared.schemas import GenerationRequest, Request, requests_batch, to_ipc
from shared.settings import Settings
from shared.stream_consumer import Entry, StreamConsumer
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
        self.consumer = StreamConsumer(self.client, names.streams(names.JOBS), names.TOKENIZER_GROUP, self.worker_id,
                                       names.TOKENIZER_POOL, settings.claim_idle_ms, settings.delivery_limit)
        self.jobs = JobOps(self.client, settings.job_ttl_s)
        self.prompts = PromptBuilder(settings.model_path)
        self.context = model_context(settings.model_path, settings.max_model_len)
        self.stop_event = threading.Event()
        self.counters = {"processed": 0, "failed": 0, "batches": 0}
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
            self._process(stream, group)

    def _process(self, stream: str, entries: list[Entry]) -> None:
        """Tokenize one partition's entries (one record batch, a row per job) and queue the jobs in the
        partition's fair queue. A job that cannot be tokenized fails alone, with its reason; nothing a
        request holds can stop this loop."""
        accepted: list[tuple[str, GenerationRequest]] = []
        prompts: list[str | None] = []  # None: given as token ids
        job_ids = [_field(e.fields, "job_id") for e in entries]
        pipe = self.client.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hmget(names.job_key(job_id or "?"), "status", "cancel_requested")
        states = pipe.execute()
        for entry, job_id, (status, cancel) in zip(entries, job_ids, states):
            if not job_id or status != b"queued" or cancel == b"1":
                continue  # cancelled, expired or already taken further: nothing to do
            try:
                req = GenerationRequest.model_validate_json(_field(entry.fields, "request") or "")
                prompt = None if req.prompt_token_ids is not None else self.prompts.render(req)
                if req.grammar is not None:
                    self._grammars().prepare(req.grammar.spec)
            except (ValidationError, PromptError) as exc:
                self._fail(job_id, f"invalid request: {exc}")
                continue
            except GrammarError as exc:
                self._fail(job_id, f"invalid grammar: {exc}")
                continue
            except Exception as exc:  # noqa: BLE001 - one job's failure is that job's alone
                log.exception("job %s could not be prepared", job_id)
                self._fail(job_id, f"the request could not be tokenized ({type(exc).__name__})")
                continue
            accepted.append((job_id, req))
            prompts.append(prompt)
        texts = [(p, req.prompt is not None) for p, (_, req) in zip(prompts, accepted) if p is not None]
        encoded = iter(self._encode([t for t, _ in texts], [raw for _, raw in texts]) if texts else [])
        ids = [req.prompt_token_ids if p is None else next(encoded) for p, (_, req) in zip(prompts, accepted)]
        requests = [req.tokenized(job_id, prompt_ids) for (job_id, req), prompt_ids in zip(accepted, ids)
                    if self._fits(job_id, prompt_ids, req.max_tokens)]
        batch = self._record_batch(requests)
        queued: list[tuple[str, int, int, bytes]] = []
        if batch is not None:
            priority = {job_id: req.priority for job_id, req in accepted}
            for i, (job_id, n) in enumerate(zip(batch.column("id").to_pylist(),
                                                batch.column("prompt_ids").value_lengths().to_pylist())):
                queued.append((job_id, priority[job_id], n, to_ipc(batch.slice(i, 1))))
        fair_queue.push(self.writer, names.stream_partition(stream), [e.id for e in entries], queued,
                        self.settings.fair_share)
        self.counters["processed"] += len(queued)
        self.counters["batches"] += 1

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

    def _record_batch(self, requests: list[Request]) -> pa.RecordBatch | None:
        """The requests as one Arrow batch; a request the schema cannot hold fails its job alone."""
        if not requests:
            return None
        try:
            return requests_batch(requests)
        except (pa.ArrowException, OverflowError, TypeError, ValueError):
            log.exception("record batch failed; building it request by request")
        good = []
        for req in requests:
            try:
                requests_batch([req])
                good.append(req)
            except (pa.ArrowException, OverflowError, TypeError, ValueError) as exc:
                self._fail(req.id, f"invalid request: a value is out of range ({exc})")
        return requests_batch(good) if good else None

    def _fits(self, job_id: str, prompt_ids: list[int] | None, max_tokens: int) -> bool:
        if prompt_ids is None:
            self._fail(job_id, "the prompt could not be tokenized")
            return False
        n = len(prompt_ids)
        if n == 0:
            self._fail(job_id, "the prompt is empty after tokenization")
            return False
        if n + max_tokens > self.context:
            self._fail(job_id, f"the prompt is {n} tokens; with max_tokens {max_tokens} it exceeds "
                               f"the model's context of {self.context} tokens")
            return False
        return True

    def _fail(self, job_id: str, error: str) -> None:
        self.counters["failed"] += 1
        self.jobs.fail(job_id, error)


def _field(fields: dict[Any, Any], name: str) -> str | None:
    """A stream entry's field as text, None when the entry has no such field."""
    v = fields.get(name.encode(), fields.get(name))
    return None if v is None else text(v)


def main(settings: Settings) -> int:
    settings.require_model(weights=False)
    worker = TokenizerWorker(settings)

    def _stop(signum: int, _frame: Any) -> None:
        log.info("signal %d: finishing the current batch and stopping", signum)
        worker.stop_event.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    worker.run()
    return 0
