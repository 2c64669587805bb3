"""Runs one engine step: prepares the batch's inputs (token ids, positions, KV-cache slots, attention
metadata), runs the model over them, then samples a token for each sequence that reaches its end."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from gpu_worker.engine.cpu_kernels import PrefillChunks
from gpu_worker.engine.device import DTYPES, resolve_device, resolve_dtype
from gpu_worker.engine.kv_cache import KVCache, bytes_per_token
from gpu_worker.engine.lora import LoraBatch, LoraManager
from gpu_worker.engine.models import AttentionMetadata, Llama, PrefillChunk
from gpu_worker.engine.models.checkpoint import load_checkpoint
from gpu_worker.engine.models.layout import CausalLM
from gpu_worker.engine.models.llama import PrefillBatch
from gpu_worker.engine.protocol import EngineConfig
from gpu_worker.engine.sampler import Sampler, padded, token_logprobs
from gpu_worker.engine.sequence import Sequence
from gpu_worker.engine.step import Sampled, StepBatch
from shared.model_config import eos_ids


@dataclass
class StepInputs:
    """One step's batch as the model takes it: decode rows first, then the prefill chunks' tokens."""
    ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens]
    attn: AttentionMetadata
    sample_rows: list[int]  # the rows whose logits are sampled: every decode row, then each completed chunk's last
    sampled: list[Sequence]  # their sequences, in the same order (a speculating sequence once per decode row)
    ahead: list[int] | None = None  # per sampled row, its place after its sequence's next token (None: all 0)
    lora: LoraBatch | None = None  # the rows under LoRA adapters, grouped by adapter; None where no row has one


class DecodeRows(NamedTuple):
    """A step's decode rows, one query token each: per sequence its newest token, then its draft's tokens
    (speculation), each a row of its own at the next position."""
    seqs: list[Sequence]
    ids: list[int]
    pos: list[int]


def _decode_rows(decode: list[Sequence]) -> DecodeRows:
    seqs, ids, pos = [], [], []
    for s in decode:
        p = s.num_computed
        seqs.append(s)
        ids.append(s.token_ids[p])
        pos.append(p)
        for i, t in enumerate(s.draft, 1):
            seqs.append(s)
            ids.append(t)
            pos.append(p + i)
    return DecodeRows(seqs, ids, pos)


def _ids_and_positions(batch: StepBatch, rows: DecodeRows) -> tuple[list[int], list[int]]:
    ids, pos = list(rows.ids), list(rows.pos)
    for s, n in batch.chunks:
        ids.extend(s.token_ids[s.num_computed : s.num_computed + n])
        pos.extend(range(s.num_computed, s.num_computed + n))
    return ids, pos


def _sampled(batch: StepBatch, decode: DecodeRows, chunks: list[PrefillChunk],
             ) -> tuple[list[int], list[Sequence], list[int] | None]:
    """The rows to sample, their sequences and places ahead (`StepInputs`): every decode row, then each chunk
    that completes its sequence."""
    seqs = list(decode.seqs)
    rows = list(range(len(seqs)))
    ahead = ([p - s.num_computed for s, p in zip(seqs, decode.pos)] if len(seqs) > len(batch.decode) else None)
    for (s, n), chunk in zip(batch.chunks, chunks):
        if s.num_computed + n == s.num_tokens:
            rows.append(chunk.offset + n - 1)
            seqs.append(s)
    if ahead is not None:
        ahead += [0] * (len(seqs) - len(ahead))
    return rows, seqs, ahead


def _generated_rows(chunks: list[tuple[Sequence, int]], placed: list[PrefillChunk]) -> tuple[DecodeRows, list[int]]:
    """The chunks' rows at generated positions (a preempted or resumed sequence's output computed again), as decode
    rows, and their rows in the step."""
    seqs, ids, pos, at = [], [], [], []
    for (s, n), c in zip(chunks, placed):
        for p in range(max(s.num_computed, s.num_prompt), s.num_computed + n):
            seqs.append(s)
            ids.append(s.token_ids[p])
            pos.append(p)
            at.append(c.offset + p - s.num_computed)
    return DecodeRows(seqs, ids, pos), at


class ModelRunner:
    """Owns the model (given, or loaded from `config.model`: read from its files by models/checkpoint.py where it
    can, else through transformers) and the KV cache sized for it."""

    def __init__(self, config: EngineConfig, model: CausalLM | None = None) -> None:
        self.device = resolve_device(config.device)
        own = model.dtype if model is not None else DTYPES.get(config.checkpoint_dtype or "")
        self.dtype = resolve_dtype(config.dtype, self.device, own)
        if model is None:
            model = load_checkpoint(config.model, self.dtype, self.device)  # without transformers, where it can
        if model is None:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(config.model, dtype=self.dtype)
        if isinstance(model, torch.nn.Module):
            module: torch.nn.Module = model  # (transformers wraps `to` in a type mypy cannot call)
            module.to(device=self.device, dtype=self.dtype).eval()  # in place: a module's `to` returns itself
        # the model taken over (transformers' or the checkpoint's tensors): its layer matrices are now views of
        # the fused ones, or emptied
        self.hf_model = model
        own_max = getattr(self.hf_model.config, "max_position_embeddings", 4096)
        self.max_model_len = min(config.max_model_len, own_max) if config.max_model_len > 0 else own_max
        generation = getattr(self.hf_model, "generation_config", None)  # config.json's and generation_config.json's
        self.eos_token_ids = eos_ids(getattr(generation, "eos_token_id", None),
                                     getattr(self.hf_model.config, "eos_token_id", None))
        self.block_size = config.block_size
        self.model = Llama(self.hf_model, self.max_model_len, self.block_size, config.cpu_kernels,
                           config.cpu_kernels and config.cpu_gemm == "packed")
        self.vocab_size = self.model.vocab_size
        self.cache = self._allocate_cache(config)
        self._block_offsets = torch.arange(self.block_size, device=self.device)
        # a layer's K (or V) seen as [KV * slots, D]: head h's slot s is row h * slots + s
        self._head_offsets = (torch.arange(self.model.kv_heads, device=self.device)[None, :, None]
                              * (self.cache.num_blocks * self.block_size))
        self._pin = self.device.type == "cuda"
        self._prefill_work = torch.empty(0, dtype=torch.int32)  # the paged prefill kernel's (`_prefill_tables`)
        self.sampler = Sampler(self.eos_token_ids)
        self.loras: LoraManager | None = None  # the engine's resident LoRA adapters, once a request names one
        # a generated position's attention is the decode kernel's however it is scheduled (decoded, or a preempted or
        # resumed sequence's output computed again in a prefill chunk), a prompt position's the prefill kernel's: the
        # two sum in other orders, and a position's K/V must not depend on how it was scheduled
        self.generated_by_decode = self.model.paged_decode is not None and self.model.paged_prefill is not None

    def _allocate_cache(self, config: EngineConfig) -> KVCache:
        """The KV pool: the budget's worth of blocks, at most enough for `max_num_seqs` contexts of
        `max_model_len` (plus the null block)."""
        m, bs = self.model, self.block_size
        per_block = bytes_per_token(len(m.layers), m.kv_heads, m.head_dim, self.dtype) * bs
        num_blocks = max(2, config.kv_cache_mb * 2**20 // per_block)
        max_cache_tokens = config.max_num_seqs * config.max_model_len
        if max_cache_tokens > 0:
            num_blocks = min(num_blocks, -(-max_cache_tokens // bs) + 1)
        return KVCache(len(m.layers), m.kv_heads, m.head_dim, num_blocks, bs, self.dtype, self.device)

    @torch.inference_mode()
    def run(self, batch: StepBatch) -> Sampled:
        """Compute the scheduled tokens, and sample a token for every sequence that reaches its end
        this step: the decode rows first, then completed chunks, in order."""
        with self.model.gemm.step():
            inputs = self.prepare(batch)
            h = self.model.forward(inputs.ids, inputs.positions, inputs.attn, self.cache, inputs.lora)
            self._prompt_logprobs(batch, inputs, h)
            return Sampled(inputs.sampled, *self.sampler(self._logits(h, inputs.sample_rows), inputs.sampled,
                                                         inputs.ahead))

    def prepare(self, batch: StepBatch) -> StepInputs:
        """The batch's token ids, positions, cache slots and attention metadata, on the device."""
        rows = _decode_rows(batch.decode)
        ids, pos = _ids_and_positions(batch, rows)
        ids_t, pos_t = self._to_device(ids), self._to_device(pos)
        slots = self._to_device(self._slots(batch, rows))  # where each token's K/V is written
        at_once = self.model.paged_prefill is not None or self.model.batch_prefill  # else chunk by chunk
        chunks = self._prefill_chunks(batch.chunks, len(rows.seqs), gather=not at_once)
        attn = AttentionMetadata(slots, len(rows.seqs), chunks=chunks)
        prompt = [(s, n, c.offset - len(rows.seqs)) for (s, n), c in zip(batch.chunks, chunks)]
        again = DecodeRows([], [], [])
        if self.generated_by_decode:
            again, at = _generated_rows(batch.chunks, chunks)
            if again.seqs:
                attn.decode_rows = self._to_device([*range(len(rows.seqs)), *at])
                prompt = [(s, min(n, s.num_prompt - s.num_computed), off) for s, n, off in prompt
                          if s.num_computed < s.num_prompt]
        if (rows.seqs or again.seqs) and self.model.paged_decode is not None:
            attn.decode_tables, attn.decode_lens = self._decode_tables(
                DecodeRows(rows.seqs + again.seqs, rows.ids + again.ids, rows.pos + again.pos))
        elif rows.seqs:
            attn.decode_len, attn.decode_index, attn.decode_mask = self._decode_reads(rows.seqs, pos_t)
        if prompt and self.model.paged_prefill is not None:
            attn.prefill_tables = self._prefill_tables(prompt)
        elif chunks and self.model.batch_prefill:
            attn.prefill = self._prefill_batch(batch.chunks)
        inputs = StepInputs(ids_t, pos_t, attn, *_sampled(batch, rows, chunks))
        if self.loras is not None and (any(s.lora is not None for s in rows.seqs)
                                       or any(s.lora is not None for s, _ in batch.chunks)):
            adapters = [s.lora for s in rows.seqs] + [s.lora for s, n in batch.chunks for _ in range(n)]
            inputs.lora = self.loras.batch(adapters)
        return inputs

    def _logits(self, h: torch.Tensor, rows: list[int]) -> torch.Tensor:
        if not rows:
            return torch.empty(0, self.vocab_size)
        if len(rows) < h.shape[0]:  # a pure decode step samples every row, in order
            h = h.index_select(0, self._to_device(rows))
        return self.model.compute_logits(h)  # the sampler upcasts only the rows it samples

    def _prompt_logprobs(self, batch: StepBatch, inputs: StepInputs, h: torch.Tensor) -> None:
        """For sequences that want their prompt's logprobs (echo): each chunk's rows give the logprobs of
        the prompt tokens that follow them (the last prompt token's row is the first sampled one instead).
        A chunk computed again (after a preemption, in other chunks than the first time) adds only the entries
        not there yet."""
        for (s, n), chunk in zip(batch.chunks, inputs.attn.chunks):
            if s.prompt_lp is None:
                continue
            p, have = s.num_computed, len(s.prompt_lp)
            if not p <= have < p + n:
                continue
            m = min(p + n, s.num_prompt - 1) - have  # rows have .. have+m-1 predict prompt tokens have+1 .. have+m
            if m <= 0:
                continue
            at = chunk.offset + have - p
            logits = self.model.compute_logits(h[at : at + m])
            for one in token_logprobs(logits, s.token_ids[have + 1 : have + 1 + m], [s.req.prompt_logprobs] * m):
                s.prompt_lp.extend(one)

    def _to_device(self, values: list[int]) -> torch.Tensor:
        t = torch.tensor(values, dtype=torch.long)
        if self._pin:
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def _slots(self, batch: StepBatch, rows: DecodeRows) -> list[int]:
        bs = self.block_size
        out = [s.block_table[p // bs] * bs + p % bs for s, p in zip(rows.seqs, rows.pos)]
        for s, n in batch.chunks:
            table = s.block_table
            out.extend(table[p // bs] * bs + p % bs for p in range(s.num_computed, s.num_computed + n))
        return out

    def _decode_tables(self, rows: DecodeRows) -> tuple[torch.Tensor, torch.Tensor]:
        """What the decode rows read in place: each its sequence's block table (padded with the null block) and its
        own length, its position + 1 (a draft token's row reads the draft's earlier tokens, written this step)."""
        nblk = -(-(max(rows.pos) + 1) // self.block_size)
        return (padded([s.block_table for s in rows.seqs], 0, self.device, nblk, torch.int32),
                torch.tensor([p + 1 for p in rows.pos], dtype=torch.int32, device=self.device))

    def _decode_reads(self, decode: list[Sequence], positions: torch.Tensor) -> tuple[int, torch.Tensor,
                                                                                       torch.Tensor]:
        """What the decode rows read (`decode`: a row's sequence, per row): each its first `width` slots (the
        longest row's length; past its own position, the null block), as a gather index and mask
        (`_gather_index`). A draft token's row reads the draft's earlier tokens, written to the cache this step."""
        width = max(s.num_computed + len(s.draft) for s in decode) + 1
        index, mask = self._gather_index([s.block_table for s in decode], positions[: len(decode)] + 1, width)
        return width, index, mask

    def _prefill_chunks(self, chunks: list[tuple[Sequence, int]], offset: int, gather: bool) -> list[PrefillChunk]:
        """Each chunk's place in the batch, from row `offset` on, and (`gather`: for the chunk-by-chunk path) the
        gather index of what it reads from the cache when tokens before it are cached."""
        out = []
        for s, n in chunks:
            p = s.num_computed
            idx = None
            if p and gather:
                idx, _ = self._gather_index([s.block_table], torch.tensor([p + n], device=self.device), p + n)
            out.append(PrefillChunk(p, n, offset, idx))
            offset += n
        return out

    def _prefill_tables(self, chunks: list[tuple[Sequence, int, int]]) -> PrefillChunks:
        """The step's chunks (sequence, tokens, first row among the prefill rows) as the paged prefill kernel reads
        them in place, and its workspace (kept, grown as steps need more: a step's worth of packed K/V)."""
        bs, lengths = self.block_size, [n for _, n, _ in chunks]
        starts = [s.num_computed for s, _, _ in chunks]
        nblk = max(-(-(p + n) // bs) for p, n in zip(starts, lengths))
        tables = padded([s.block_table for s, _, _ in chunks], 0, torch.device("cpu"), nblk, torch.int32)
        offsets = [off for _, _, off in chunks]
        starts_t, lengths_t = (torch.tensor(x, dtype=torch.int32) for x in (starts, lengths))
        kernel = self.model.paged_prefill
        assert kernel is not None
        need = kernel.workspace(starts_t, lengths_t, self.model.kv_heads, self.model.head_dim, self.dtype)
        if self._prefill_work.numel() < need:
            self._prefill_work = torch.empty(need, dtype=torch.int32)
        return PrefillChunks(tables, starts_t, lengths_t,
                             torch.tensor(offsets, dtype=torch.int32), self._prefill_work)

    def _prefill_batch(self, chunks: list[tuple[Sequence, int]]) -> PrefillBatch:
        """The step's chunks as one padded batch (`PrefillBatch`): what each reads, and where its rows go."""
        starts, lengths = [s.num_computed for s, _ in chunks], [n for _, n in chunks]
        rows, width = max(lengths), max(p + n for p, n in zip(starts, lengths))
        ends = self._to_device([p + n for p, n in zip(starts, lengths)])
        index, _ = self._gather_index([s.block_table for s, _ in chunks], ends, width)
        pad_rows = self._to_device([b * rows + i for b, n in enumerate(lengths) for i in range(n)])
        first = self._to_device(starts)  # query row i of chunk b sits at position starts[b] + i
        blocked = (torch.arange(width, device=self.device)[None, None, :]
                   > first[:, None, None] + torch.arange(rows, device=self.device)[None, :, None])
        return PrefillBatch(starts, lengths, rows, width, index, pad_rows, blocked, first)

    def _gather_index(self, tables: list[list[int]], lengths: torch.Tensor, width: int) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor]:
        """Flat index [rows * KV * width] into a layer's K or V seen as [KV * slots, D], reading each row's
        first `width` tokens per head (the null block past its length): one index_select gives them
        as a contiguous [rows, KV, width, D]. And the [rows, 1, 1, width] mask of the row's own positions."""
        bs = self.block_size
        nblk = -(-width // bs)
        table = padded(tables, 0, torch.device("cpu"), nblk).to(self.device)
        idx = (table[:, :, None] * bs + self._block_offsets[None, None, :]).view(len(tables), -1)[:, :width]
        mask = torch.arange(width, device=self.device)[None, :] < lengths[:, None]
        idx = torch.where(mask, idx, 0)
        return (idx[:, None, :] + self._head_offsets).reshape(-1), mask.view(len(tables), 1, 1, width)
