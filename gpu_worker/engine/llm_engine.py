"""The engine: add requests, abort them, step. Each step is schedule -> run -> postprocess."""

from __future__ import annotations

import logging
from collections import deque

import torch

from gpu_worker.engine.block_manager import BlockManager
from gpu_worker.engine.lora import LoraAdapter, LoraManager
from gpu_worker.engine.model_runner import ModelRunner
from gpu_worker.engine.models.layout import CausalLM
from gpu_worker.engine.ngram import NgramIndex
from gpu_worker.engine.protocol import EngineConfig
from gpu_worker.engine.scheduler import Scheduler
from gpu_worker.engine.sequence import Sequence
from gpu_worker.engine.step import Sampled, StepBatch, StepOutput
from shared.jobs import FinishReason
from shared.lora import Dims
from shared.schemas import Request

log = logging.getLogger("conveyor.engine")


# Tokens per step when not configured. On CPU a step's time grows with its tokens, and a prefill chunk
# stalls every decoding row for that long: 256 halves the stall of 512 at equal throughput (BENCHMARKS.md).
# A GPU step costs about the same from 1 to thousands of tokens, so it takes much more.
DEFAULT_BATCHED_TOKENS = {"cpu": 256, "cuda": 2048}
# Tokens per step when not configured and no sequence is decoding (a burst of new prompts): the step stalls
# nobody, and on CPU larger steps prefill faster (larger GEMMs, more chunks to each attention call): 32 distinct
# ~480-token prompts in bf16, 5.6 s at 4,096 against 6.2 s at 256 (BENCHMARKS.md, "Prefill burst").
DEFAULT_PREFILL_TOKENS = {"cpu": 4096, "cuda": 2048}


class LLMEngine:
    def __init__(self, config: EngineConfig, model: CausalLM | None = None) -> None:
        if config.threads > 0:
            torch.set_num_threads(config.threads)
        self.config = config
        self.runner = ModelRunner(config, model)
        cache = self.runner.cache
        self.blocks = BlockManager(cache.num_blocks, cache.block_size, config.prefix_caching,
                                   self.runner.generated_by_decode)
        if self.blocks.blocks_for(self.runner.max_model_len) > self.blocks.usable_blocks:  # as vLLM, refused at the
            # start: a request the door accepts would otherwise fail part-way through its output
            raise ValueError(f"the KV cache holds {self.blocks.usable_blocks * cache.block_size} tokens, less than one "
                             f"context of {self.runner.max_model_len} (MAX_MODEL_LEN): raise KV_CACHE_MB or lower "
                             "MAX_MODEL_LEN")
        device = self.runner.device.type
        # tokens per step while some sequence decodes, and while none does: one budget when configured
        batched = config.max_num_batched_tokens or DEFAULT_BATCHED_TOKENS.get(device, 512)
        prefill_only = config.max_num_batched_tokens or DEFAULT_PREFILL_TOKENS.get(device, batched)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, batched, self.runner.max_model_len,
                                   prefill_only, config.admit_every)
        self.seqs: dict[str, Sequence] = {}
        self._pending: list[StepOutput] = []
        self._loras: LoraManager | None = None  # made when the first request names an adapter
        self.lora_waiting: deque[Request] = deque()  # requests whose adapter waits for a resident one to free
        self.num_draft_tokens = 0  # speculation, cumulative: draft tokens computed, and of those kept
        self.num_accepted_tokens = 0

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def batch_invariant(self) -> bool:
        return self.runner.model.batch_invariant

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.runner.eos_token_ids

    @property
    def loras(self) -> LoraManager:
        if self._loras is None:
            runner = self.runner
            cfg = runner.hf_model.config  # transformers' config, or the checkpoint loader's namespace
            dims = Dims.of_config(cfg.to_dict() if hasattr(cfg, "to_dict") else vars(cfg))
            self._loras = LoraManager(dims, runner.dtype, runner.device,
                                      runner.model.gemm, self.config.max_loras, self.config.max_lora_rank)
            runner.loras = self._loras
        return self._loras

    def add_request(self, req: Request) -> None:
        if req.id in self.seqs or any(r.id == req.id for r in self.lora_waiting):
            raise ValueError(f"request {req.id!r} is already in the engine")
        problem = self._check(req)
        if problem:
            self._pending.append(StepOutput(req.id, finish_reason=FinishReason.error, error=problem))
            return
        if req.lora:
            self.lora_waiting.append(req)
            self._admit_lora_waiting()
            return
        self._admit(req, None)

    def _admit_lora_waiting(self) -> None:
        """Requests whose adapter is resident, or can be loaded (a resident one no live request holds evicted), join
        the scheduler, in arrival order; the others wait for a resident adapter to free. A bad adapter fails its
        request alone. Loading reads the adapter's files here, in the engine loop: a few ms at small ranks, once
        per adapter while it stays resident."""
        for req in list(self.lora_waiting):
            try:
                adapter = self.loras.acquire(req.lora, req.lora_path)
            except Exception as exc:  # noqa: BLE001 - a bad adapter fails its request alone
                self.lora_waiting.remove(req)
                self._pending.append(StepOutput(req.id, finish_reason=FinishReason.error,
                                                error=f"the LoRA adapter {req.lora!r} could not be loaded: {exc}"))
                continue
            if adapter is not None:
                self.lora_waiting.remove(req)
                self._admit(req, adapter)

    def _admit(self, req: Request, adapter: LoraAdapter | None) -> None:
        seq = Sequence(req)
        seq.lora = adapter
        end: StepOutput | None = None
        if req.grammar_kind:
            try:
                seq.grammar = self._grammar(req)
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                end = StepOutput(req.id, finish_reason=FinishReason.error, error=f"the grammar failed: {exc}")
        if end is None and req.resume_ids and self._finish_reason(seq, req.resume_ids[-1]) is FinishReason.stop:
            end = StepOutput(req.id, finish_reason=FinishReason.stop)
        if end is None and seq.num_generated >= req.max_tokens:
            end = StepOutput(req.id, finish_reason=FinishReason.length)
        if end is not None:
            self._pending.append(end)
            if adapter is not None:
                self.loras.release(adapter)
            return
        if self.config.speculative is not None and not req.shapes_logits:
            seq.ngrams = NgramIndex(self.config.speculative)  # (a draft cannot follow penalties or a grammar)
        self.seqs[req.id] = seq
        self.scheduler.add(seq)

    def _drop(self, seq: Sequence) -> None:
        """The sequence leaves the engine: its slot, its blocks and its hold on its adapter."""
        self.seqs.pop(seq.id, None)
        self.scheduler.remove(seq)
        if seq.lora is not None:
            self.loras.release(seq.lora)
            seq.lora = None

    @staticmethod
    def _grammar(req: Request) -> object:
        """The request's grammar matcher, caught up with the tokens it already generated (a resumed job)."""
        from gpu_worker.engine.grammar import GrammarState  # xgrammar loads only once a grammar arrives

        if req.compiled_grammar is None:
            raise ValueError("the request's grammar was not compiled")
        state = GrammarState(req.compiled_grammar)
        state.replay(req.resume_ids)
        return state

    def _check(self, req: Request) -> str | None:
        """What would make this request fail a whole step, caught before it joins one: what only the engine
        knows (its vocabulary), and the bounds the door guarantees, asserted (Request.out_of_bounds)."""
        if not req.prompt_ids:
            return "empty prompt"
        vocab = self.runner.vocab_size
        for name, ids in (("prompt", req.prompt_ids), ("resumed", req.resume_ids), ("logit_bias", req.bias_ids)):
            if ids and (min(ids) < 0 or max(ids) >= vocab):
                return f"{name} token ids must be in [0, {vocab})"
        return req.out_of_bounds()

    def abort_request(self, req_id: str, reason: FinishReason = FinishReason.cancelled) -> bool:
        seq = self.seqs.get(req_id)
        if seq is None:
            waiting = next((r for r in self.lora_waiting if r.id == req_id), None)
            if waiting is None:
                return False
            self.lora_waiting.remove(waiting)
        else:
            self._drop(seq)
        self._pending.append(StepOutput(req_id, finish_reason=FinishReason(reason)))
        return True

    def has_unfinished(self) -> bool:
        return bool(self._pending or self.lora_waiting) or self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self.lora_waiting)

    def kv_usage(self) -> float:
        """Share of the KV blocks held by running sequences (cached blocks nobody holds are free)."""
        return self.blocks.num_used / self.blocks.usable_blocks

    def preemptions(self) -> tuple[int, int, int]:
        s = self.scheduler
        return s.num_preemptions, s.num_fair_preemptions, s.num_priority_preemptions

    def speculation(self) -> tuple[int, int]:
        return self.num_draft_tokens, self.num_accepted_tokens

    def lora_counts(self) -> tuple[int, int, int]:
        m = self._loras
        return (len(m.resident), m.loads, m.evictions) if m is not None else (0, 0, 0)

    def step(self) -> list[StepOutput]:
        if self.lora_waiting:
            self._admit_lora_waiting()
        outputs, self._pending = self._pending, []
        self._propose()
        batch, rejected = self.scheduler.schedule()
        for seq in rejected:
            outputs.append(self._fail(seq, f"sequence of {seq.num_tokens} tokens does not fit the KV cache "
                                           f"or the context of {self.max_model_len} tokens"))
        if batch.num_tokens == 0:
            return outputs
        sampled, failed = self._run(batch)
        return outputs + self._postprocess(batch, sampled, failed)

    def _propose(self) -> None:
        """Drafts for the decoding sequences that speculate (ngram.py), never past their max_tokens or the
        context; the scheduler trims them to the step's budget and free blocks."""
        for s in self.scheduler.running:
            if s.ngrams is not None and s.decoding:
                room = min(s.req.max_tokens - s.num_generated, self.max_model_len - s.num_tokens) - 1
                s.draft = s.ngrams.propose(s.token_ids, room)

    def _run(self, batch: StepBatch) -> tuple[Sampled, dict[str, str]]:
        """The step's sampled tokens, and the sequences that failed it. When the batched step raises, each
        sequence runs alone (a step rewrites the same cache positions, so running again is safe):
        only the one that raises fails, the rest of the batch goes on."""
        try:
            return self.runner.run(batch), {}
        except Exception as exc:  # noqa: BLE001 - isolated below
            if len(batch.decode) + len(batch.chunks) == 1:
                seq = (batch.decode or [s for s, _ in batch.chunks])[0]
                log.exception("step failed for %s", seq.id)
                return Sampled(), {seq.id: f"the model step failed: {exc}"}
            log.exception("batched step failed; running its %d sequences one by one",
                          len(batch.decode) + len(batch.chunks))
        parts = [StepBatch([s], []) for s in batch.decode] + [StepBatch([], [c]) for c in batch.chunks]
        sampled, failed = Sampled(), {}
        for part in parts:
            seq = (part.decode or [s for s, _ in part.chunks])[0]
            try:
                sampled.extend(self.runner.run(part))
            except Exception as exc:  # noqa: BLE001
                log.exception("step failed for %s", seq.id)
                failed[seq.id] = f"the model step failed: {exc}"
        return sampled, failed

    def _postprocess(self, batch: StepBatch, sampled: Sampled, failed: dict[str, str]) -> list[StepOutput]:
        outputs = [self._fail(self.seqs[i], why) for i, why in failed.items() if i in self.seqs]
        for s in batch.decode:
            if s.id not in failed:
                s.num_computed += 1
        for s, n in batch.chunks:
            if s.id not in failed:
                s.num_computed += n
        for s in batch.decode + [s for s, _ in batch.chunks]:
            if s.id not in failed:
                self.blocks.register(s)  # full blocks now computed join the prefix cache
        i = 0
        while i < len(sampled.seqs):  # a sequence's rows: its next token's, then one per draft token
            seq = sampled.seqs[i]
            out = self._accept(seq, sampled, i)
            if out is not None:
                outputs.append(out)
            i += 1 + len(seq.draft)
        for s in batch.decode:
            s.draft = []
        return outputs

    def _accept(self, seq: Sequence, sampled: Sampled, first: int) -> StepOutput | None:
        """The sequence's tokens from its rows from `first` on. The first row's token is its next; each draft
        token the sampler drew too (its row's token equals it) makes the next row's token valid as well, so
        the tokens kept are exactly those sampling without the draft gives (its draws go by token index)."""
        out: StepOutput | None = None
        draft = seq.draft
        self.num_draft_tokens += len(draft)
        for j in range(1 + len(draft)):
            row, token = first + j, sampled.tokens[first + j]
            if row in sampled.errors:  # after a kept token, the rest of the draft is dropped instead
                return self._fail(seq, sampled.errors[row]) if out is None else out
            if seq.grammar is not None and not seq.grammar.accept(token):
                return self._fail(seq, f"the grammar refused token {token}")
            seq.token_ids.append(token)
            if j:
                seq.num_computed += 1  # the draft token at this row's position was right: its K/V stands
                self.num_accepted_tokens += 1
            reason = self._finish_reason(seq, token)
            lp = sampled.logprobs[row] if sampled.logprobs else None
            if out is None:
                out = StepOutput(seq.id, [token], reason, logprobs=lp)
                if seq.num_generated == 1 + len(seq.req.resume_ids):  # its first token here
                    out.scheduled_at = seq.scheduled_at
                if seq.prompt_lp is not None:  # the prompt completed this step: its logprobs go with the first token
                    out.prompt_ids, out.prompt_logprobs = list(seq.req.prompt_ids), seq.prompt_lp
                    seq.prompt_lp = None
            else:
                out.token_ids.append(token)
                out.finish_reason = reason
                if lp is not None and out.logprobs is not None:
                    out.logprobs.extend(lp)
            if seq.timeline:  # a traced job's events go out with its tokens
                out.timeline, seq.timeline = seq.timeline, []
            if reason is not None:
                self._drop(seq)
                break
            if j == len(draft) or token != draft[j]:
                break
        return out

    def _fail(self, seq: Sequence, error: str) -> StepOutput:
        self._drop(seq)
        return StepOutput(seq.id, finish_reason=FinishReason.error, error=error)

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        req = seq.req
        if token in req.stop_token_ids or (not req.ignore_eos and token in self.eos_token_ids):
            return FinishReason.stop
        if seq.grammar is not None and seq.grammar.is_terminated():  # the output is complete: nothing may follow
            return FinishReason.stop
        if seq.num_generated >= req.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.length
        return None
