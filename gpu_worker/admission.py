"""Admission: the job of a `tokenized` entry is started, or resumed where another worker left it.

The output lane learns a job (its stop strings, where its stream stands) before the engine gets
it, so the lane knows every job whose tokens it receives.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from multiprocessing.queues import Queue
from queue import SimpleQueue
from typing import TYPE_CHECKING

from gpu_worker.ledger import EntryLedger
from gpu_worker.messages import Add, EngineCommand, LaneCommand, Register
from gpu_worker.stats import WorkerStats
from shared import names
from shared.job_ops import JobOps, unpack_ids
from shared.jobs import FinishReason, JobStatus
from shared.lora import LoraModule, registered
from shared.masters import Elsewhere
from shared.redis_client import RETRYABLE
from shared.schemas import Request, decode_request
from shared.scripts.codes import FinishCode, StartCode, StartReply
from shared.stream_consumer import Entry, StreamConsumer

if TYPE_CHECKING:
    from gpu_worker.grammar import GrammarLoader

log = logging.getLogger("conveyor.inference")

STARTED, RESUMED = StartCode.started, StartCode.resumed  # start.lua: a job to run here


def entry_request(entry: Entry) -> Request:
    """The request a `tokenized` entry carries (one job an entry); ValueError when it holds none."""
    raw = entry.fields.get(b"batch", entry.fields.get("batch"))
    if raw is None:
        raise ValueError("the entry has no tokenized record")
    return decode_request(raw if isinstance(raw, bytes) else str(raw).encode())


class Admission:
    def __init__(self, consumer: StreamConsumer, jobs: JobOps, ledger: EntryLedger, worker_id: str,
                 inbox: SimpleQueue[EngineCommand], to_lane: Queue[LaneCommand], stats: WorkerStats,
                 grammars: Callable[[], GrammarLoader] | None = None,
                 loras: Mapping[str, LoraModule] | None = None, starts: JobOps | None = None, model: str = "") -> None:
        self.consumer, self.jobs, self.ledger = consumer, jobs, ledger
        # the job's start and what an earlier worker recorded of it: on a cluster, read on a client that does not
        # retry (shared/masters.py), so that a master that does not answer fails its own job's admission at once
        # (the reader holds that entry) rather than holding every partition's
        self.starts = starts or jobs
        self.loras = loras or {}  # LORA_MODULES; those loaded at run time are read from the registry
        self.model = model  # the served model's name: an adapter of another model is not served here
        self.worker_id, self.inbox, self.to_lane, self.stats = worker_id, inbox, to_lane, stats
        self._new_loader = grammars
        self._loader: GrammarLoader | None = None  # made when the first grammar arrives

    def admit(self, entry: Entry) -> None:
        try:
            req = entry_request(entry)
        except Exception as exc:  # noqa: BLE001 - whatever the entry holds, it goes to the dead letters alone
            self.consumer.dead_letter(entry, f"unreadable tokenized record: {exc}")
            return
        if self.ledger.join(entry.ref, req.id):  # handed out again while it runs here (a failover lost the first)
            log.warning("job %s handed out again (entry %s) while it runs here: it goes on", req.id, entry.id)
            return
        if req.lora and req.lora not in self.loras and self.consumer.masters.is_down(names.LORAS):
            raise Elsewhere(names.LORAS)  # (its adapter is read there once it answers: not started meanwhile)
        refused = self._attach_lora(req)
        if refused:  # a job still queued fails unstarted: the request's own error (a 400), not one to retry
            ended = self.jobs.finish(req.id, FinishReason.error, refused, required_status=JobStatus.queued.value)
            if ended is not None and ended.code is FinishCode.finished:
                self.consumer.ack_each([entry.ref])
                return
        took = self.starts.start(req.id, self.worker_id)
        if took.code is StartCode.cancel_requested:  # asked of an engine that died before it stopped the job
            self.jobs.finish(req.id, FinishReason.cancelled, owner=took.owner)
        if took.code in (STARTED, RESUMED) and refused:  # one started before (resumed here) fails as it ran
            self.jobs.fail(req.id, refused, self.worker_id)
        if took.code not in (STARTED, RESUMED) or refused or not self._attach_grammar(req):
            self.consumer.ack_each([entry.ref])  # the job already ended (or was cancelled) elsewhere, or failed here
            return
        # everything read from Redis before the ledger holds the entry: a failure here (Redis gone) leaves nothing
        # held, and the reader admits the entry again once Redis answers (`Reader.held`, `readmit_forgotten`)
        register = self._register(req, took)
        self.ledger.open(entry.ref, req.id)
        self.ledger.take_slot(req.id, took.tenant, req.priority)
        self.to_lane.put(register)
        self.inbox.put(Add(req))

    def _register(self, req: Request, took: StartReply) -> Register:
        """What the output lane learns of the job before the engine gets it; a resumed job continues from what
        its earlier worker recorded."""
        emitted, seq, lp_bytes = "", took.seq, 0
        req.tenant = took.tenant
        if took.code == RESUMED:
            req.resume_ids, emitted, seq, lp_bytes = self.progress(req.id)
            self.stats.jobs_resumed += 1
        self.stats.jobs_started += 1
        return Register(
            job_id=req.id, stop=tuple(req.stop), created_at=took.created_at, min_tokens=req.min_tokens,
            include_stop=req.include_stop_str_in_output,
            prompt_tokens=len(req.prompt_ids),
            started=took.code == STARTED, seq=seq, resume_ids=tuple(req.resume_ids), emitted=emitted,
            tenant=took.tenant, weight=took.weight, logprob_bytes=lp_bytes, worker=self.worker_id,
            owner=took.owner, trace=req.trace, tokenize_at=req.tokenize_at, tokenized_at=req.tokenized_at,
            admitted_at=time.time() if req.trace else 0.0)

    def _attach_grammar(self, req: Request) -> bool:
        """The request's compiled grammar (the tokenizer pool compiled it; gpu_worker/grammar.py loads it), here
        in the reader thread rather than the engine loop; a grammar that cannot be loaded fails its job alone."""
        spec = req.grammar_spec
        if spec is None:
            return True
        try:
            if self._loader is None:
                if self._new_loader is None:
                    raise RuntimeError("this worker takes no grammars")
                self._loader = self._new_loader()
            req.compiled_grammar = self._loader.load(spec.key, spec, names.job_partition(req.id))
            return True
        except RETRYABLE:
            raise  # (its master does not answer: the entry is held, and admitted again once it does)
        except Exception as exc:  # noqa: BLE001 - this job fails alone
            log.exception("job %s: its grammar could not be loaded", req.id)
            self.jobs.fail(req.id, f"the grammar could not be loaded: {exc}", self.worker_id)
            return False

    def _attach_lora(self, req: Request) -> str | None:
        """The directory of the request's adapter (LORA_MODULES', else the registry's), or why the job cannot run:
        its adapter is no longer served (unloaded after the job was accepted, or loaded again for another model), or
        its directory is not here (a volume the API has and this worker has not). The engine reads its files."""
        if not req.lora:
            return None
        module = self.loras.get(req.lora)
        if module is None:
            try:
                module = registered(self.starts.client, req.lora)
            except RETRYABLE as exc:
                if not self.consumer.masters.cluster:
                    raise
                self.consumer.masters.failed_key(names.LORAS, exc)
                raise Elsewhere(names.LORAS) from exc
        if module is None or (self.model and module.base_model_name not in ("", self.model)):
            return f"the LoRA adapter {req.lora!r} is no longer served (unloaded)"
        if not os.path.isfile(os.path.join(module.path, "adapter_config.json")):
            return f"the LoRA adapter {req.lora!r} cannot be read here: no adapter at {module.path}"
        req.lora_path = module.path
        return None

    def progress(self, job_id: str) -> tuple[list[int], str, int, int]:
        """What the job's earlier worker recorded: its token ids, their streamed text, the last event seq,
        the bytes of its logprob entries."""
        packed, text, seq, lp_bytes = self.starts.resume_state(job_id)
        return unpack_ids(packed), text, seq, lp_bytes
