"""The Llama-family model the runner runs (Llama, Mistral, Qwen2/3, SmolLM and others with the same layer
shape): its fused weights, and its forward over a flat token batch and the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from gpu_worker.engine.cpu_kernels import (
    PrefillChunks,
    load_layer_ops,
    load_paged_decode,
    load_paged_prefill,
    supports_layer_ops,
    supports_paged_decode,
    supports_paged_prefill,
)
from gpu_worker.engine.gemm import Gemm, OneDnnGemm, PackedGemm, choose_gemm
from gpu_worker.engine.kv_cache import KVCache
from gpu_worker.engine.lora import LoraBatch
from gpu_worker.engine.models.layout import Activation, CausalLM, DecoderLayer, Linear, RotaryEmbedding
from shared.model_config import ENGINE_ARCHS


def check_architecture(cfg: Any, max_len: int) -> None:
    """ValueError naming why the engine cannot run a model of this config for a context of `max_len`: an
    architecture not in ENGINE_ARCHS (each checked against transformers' forward in tests/gpu_worker/engine/
    test_engine.py: another with a Llama's attribute names, gemma's norms and embedding scale or granite's
    multipliers, would load and compute other numbers without a word), or sliding-window attention whose window is
    shorter than the context."""
    arch = getattr(cfg, "model_type", None)
    if arch not in ENGINE_ARCHS:
        raise ValueError(f"model_type {arch!r}: the engine runs {', '.join(ENGINE_ARCHS)}")
    window = getattr(cfg, "sliding_window", None)
    sliding = arch == "mistral" or bool(getattr(cfg, "use_sliding_window", False))
    if sliding and isinstance(window, int) and 0 < window < max_len:
        raise ValueError(f"sliding-window attention (a window of {window} tokens) is not run by the engine: set "
                         f"MAX_MODEL_LEN to at most {window}")


# Decode attention in half precision on CPU: batched matmuls once the rows read this many cached tokens
# in all (per KV head), SDPA computed in float32 below that. Per layer, 100 tokens a row: 1 row 21 us
# SDPA / 40 us matmuls, 4 rows 41 / 45, 8 rows 68 / 54; 400 tokens a row: 1 row 38 / 45, 2 rows 56 / 50
# (`python -m bench.attention`, BENCHMARKS.md).
MATMUL_ATTENTION_MIN_READ = 600

# Prefill attention in half precision on CPU: the step's chunks as one padded batch, in blocks of this many
# query rows, each block reading only the keys its rows can see (`Llama._prefill_batch`).
PREFILL_BLOCK_ROWS = 64


class PrefillChunk(NamedTuple):
    """A prefill chunk's place in the step: its sequence's first position computed, its token count,
    its first row in the batch, and the gather index of its sequence's tokens up to its end in the
    cache (None when the chunk starts the sequence: it attends within itself)."""
    start: int
    length: int
    offset: int
    gather: torch.Tensor | None


@dataclass
class PrefillBatch:
    """A step's prefill chunks as one padded batch: chunk b's queries are rows b * rows .. b * rows + its
    length - 1, and it reads the first `width` tokens of its sequence (its own chunk included, the null
    block past its end), gathered from the cache as [chunks, KV, width, D]."""
    starts: list[int]  # each chunk's first position (the tokens it follows, cached)
    lengths: list[int]  # its token count
    rows: int  # the longest chunk's
    width: int  # the longest read, start + length
    index: torch.Tensor  # [chunks * KV * width] gather index
    pad_rows: torch.Tensor  # [prefill tokens]: each token's row in the padded batch, in step order
    blocked: torch.Tensor  # [chunks, rows, width] bool: key past the query's position
    first: torch.Tensor  # [chunks] int64: `starts` on the device


class PrefillBlock(NamedTuple):
    """A block of query rows of the padded prefill batch (`PrefillBatch`): rows start..end-1 read keys
    0..keys-1, those from `masked` on through `bias`, [chunks * KV, G * rows, keys - masked] (0 or -inf):
    every row of the block sees every key before `masked`."""
    start: int
    end: int
    keys: int
    masked: int
    bias: torch.Tensor | None


@dataclass
class AttentionMetadata:
    """What a step's attention writes and reads, as the runner prepares it: decode rows first, one
    token each, then the prefill chunks. Gather indices address a layer's K or V seen as
    [KV * slots, D] (head h's slot s is row h * slots + s)."""
    slots: torch.Tensor  # [tokens]: the cache slot each token's K/V is written to
    num_decode: int
    decode_len: int = 0  # tokens each decode row reads: the longest row's, the others padded
    decode_index: torch.Tensor | None = None  # [rows * KV * decode_len]
    decode_mask: torch.Tensor | None = None  # [rows, 1, 1, decode_len]: the row's own positions
    decode_tables: torch.Tensor | None = None  # [rows, blocks] int32, read in place (`Llama.paged_decode`)
    decode_lens: torch.Tensor | None = None  # [rows] int32: the tokens each row reads, in place
    # the rows the decode kernel reads, where besides the decode rows it reads prefill rows at generated positions
    # (a preempted or resumed sequence's output, computed again as it was first): the decode rows, then those
    decode_rows: torch.Tensor | None = None
    chunks: list[PrefillChunk] = field(default_factory=list)
    prefill: PrefillBatch | None = None  # the chunks batched, where the model attends them at once
    prefill_tables: PrefillChunks | None = None  # the chunks as read in place (`Llama.paged_prefill`)


@dataclass
class _Layer:
    """One decoder layer's weights, with q/k/v and gate/up fused into single matrices; the four
    matrices are held as the GEMM backend prepared them (a tensor in the backend's own layout)."""
    ln1: torch.Tensor
    ln2: torch.Tensor
    eps: float
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor
    down: torch.Tensor
    act: Activation
    silu: bool  # the activation is SiLU (`LayerOps.silu_mul` computes act(gate) * up at once)
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


def _fuse(linears: list[Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of linears that read the same input, then point each
    linear's parameters at its slice of the result, so the model holds no second copy."""
    weight = torch.cat([m.weight.detach() for m in linears])
    biases = [m.bias.detach() for m in linears if m.bias is not None]
    if biases and len(biases) < len(linears):
        raise ValueError("cannot fuse linears where only some have a bias")
    bias = torch.cat(biases) if biases else None
    at = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = weight[at : at + n]
        if bias is not None and m.bias is not None:  # every linear has one
            m.bias.data = bias[at : at + n]
        at += n
    return weight, bias


def _eps(norm: Any) -> float:
    """The norm's epsilon: transformers' RMSNorm holds it as `variance_epsilon`, torch's as `eps`."""
    return float(getattr(norm, "variance_epsilon", None) or norm.eps)


def _is_silu(act: object) -> bool:
    return act is F.silu or isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _layer_weights(layer: DecoderLayer, gemm: Gemm) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp
    qkv, qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
    gate_up, _ = _fuse([mlp.gate_proj, mlp.up_proj])
    if mlp.gate_proj.bias is not None or mlp.down_proj.bias is not None:
        raise ValueError("MLP biases are not supported")
    weights = _Layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, _eps(layer.input_layernorm),
                     gemm.prepare(qkv), qkv_bias, gemm.prepare(attn.o_proj.weight), attn.o_proj.bias,
                     gemm.prepare(gate_up), gemm.prepare(mlp.down_proj.weight), mlp.act_fn, _is_silu(mlp.act_fn),
                     attn.q_norm.weight if hasattr(attn, "q_norm") else None,
                     attn.k_norm.weight if hasattr(attn, "k_norm") else None)
    if gemm.copies_weights:  # these layers' matrices now live here: keep one copy, not two
        for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            m.weight.data = m.weight.data.new_empty(0)
    return weights


class Llama:
    """A Llama-family decoder over a flat token batch: the linear layers see every scheduled token at
    once (decode rows and prefill chunks together, no padding). Every new token's K/V is written to
    its slot of the paged cache in one call per layer; decode rows then read their blocks (gathered to
    a common length, the null block as padding) in one batched attention call, or on CPU read them in place
    (cpu_kernels.py) where its kernel builds. Prefill chunks, on CPU with AVX512 or AVX2, attend all at once in one
    kernel call reading the cache in place (`paged_prefill`); else on CPU in half precision as one padded batch
    of matmuls over the cache (`_prefill_batch`); elsewhere one by one through SDPA, over the cache when tokens
    before them are cached, over themselves when they start the sequence.

    It takes over the transformers model it is built from (already on its device, in its dtype): q/k/v
    and gate/up weights are concatenated into one matrix each (that model's parameters become views of
    it), and where the GEMM backend keeps its own layout (oneDNN on CPU in bfloat16) that model's layer
    matrices are emptied."""

    def __init__(self, hf_model: CausalLM, max_len: int, block_size: int = 16,
                 cpu_kernels: bool = True, packed_gemm: bool = False) -> None:
        cfg, inner = hf_model.config, hf_model.model
        check_architecture(cfg, max_len)
        self.num_heads = cfg.num_attention_heads
        self.kv_heads: int = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim: int = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.vocab_size = cfg.vocab_size
        self.hidden_shape = (cfg.hidden_size,)
        self.embed_w = inner.embed_tokens.weight
        self.dtype, self.device = self.embed_w.dtype, self.embed_w.device
        self.gemm, self.head_gemm = choose_gemm(self.device, self.dtype, packed=packed_gemm)
        with torch.no_grad():
            self.layers = [_layer_weights(layer, self.gemm) for layer in inner.layers]
            self.lm_head_w = self.head_gemm.prepare(hf_model.lm_head.weight)
        self.norm_w = inner.norm.weight
        self.norm_eps = _eps(inner.norm)
        self.cos, self.sin_signed = self._rope_tables(inner.rotary_emb, max_len)
        self.upcast_attention = self.device.type == "cpu" and self.dtype != torch.float32
        self.batch_prefill = self.upcast_attention  # prefill attention as batched matmuls (`_prefill_batch`)
        self.block_size = block_size
        # compiled CPU kernels (cpu_kernels.py), where they build: decode attention in place, fused elementwise steps
        self.paged_decode = (load_paged_decode() if cpu_kernels and supports_paged_decode(
            self.device, self.dtype, self.num_heads, self.kv_heads, self.head_dim) else None)
        self.paged_prefill = (load_paged_prefill() if cpu_kernels and supports_paged_prefill(
            self.device, self.dtype, self.num_heads, self.kv_heads, self.head_dim) else None)
        if self.paged_prefill is not None and self.dtype not in self.paged_prefill.dtypes:
            self.paged_prefill = None  # bfloat16 on a CPU without AVX512-BF16
        self.ops = (load_layer_ops() if cpu_kernels and supports_layer_ops(self.device, self.dtype, self.head_dim)
                    else None)
        # some layer applies RoPE through torch ops (no fused kernel, or q/k norms first): per-token cos/sin a step
        self.torch_rope = self.ops is None or any(L.q_norm is not None for L in self.layers)

    @property
    def batch_invariant(self) -> bool:
        """Whether a row's bits are the same whatever shares its step (README, "Batch invariance"), so that a seed
        gives one text: on CPU with both compiled attention kernels and a GEMM that sums each row in one order at
        every row count (ours, or oneDNN's with a lone row split). Not on CUDA, nor on torch's attention paths
        (CPU_KERNELS=false, no compiler, bfloat16 without AVX512-BF16), which switch by batch size."""
        summed_alike = (PackedGemm, OneDnnGemm)
        return (self.device.type == "cpu" and self.paged_decode is not None and self.paged_prefill is not None
                and isinstance(self.gemm, summed_alike) and isinstance(self.head_gemm, summed_alike))

    def _rope_tables(self, rotary_emb: RotaryEmbedding, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin per position, [max_len, head_dim]: RoPE as x * cos + roll(x, D/2) * sin_signed,
        rotate_half(x) * sin with the sign moved onto sin."""
        with torch.inference_mode():
            pos = torch.arange(max_len, device=self.device)[None]
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = rotary_emb(probe, pos)
            half = self.head_dim // 2
            return cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                cache: KVCache, lora: LoraBatch | None = None) -> torch.Tensor:
        """The last layer's hidden states, [tokens, hidden]; every token's K/V is written to the cache. `lora`: the
        step's rows under LoRA adapters (gpu_worker/engine/lora.py), each projection's update added on its rows."""
        cos = sin = None
        if self.torch_rope:
            cos, sin = self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)  # [N, 1, D]
        bias = self._decode_bias(attn)
        blocks = self._prefill_blocks(attn.prefill) if attn.prefill is not None else []
        h = F.embedding(ids, self.embed_w)
        for li, L in enumerate(self.layers):
            h = self._layer(L, h, positions, cos, sin, cache.k[li], cache.v[li], attn, bias, blocks,
                            (lora, li) if lora is not None else None)
        return h

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype for the hidden states given (the rows to sample)."""
        return self.head_gemm.linear(self._norm(h, self.norm_w, self.norm_eps), self.lm_head_w)

    def _norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        if self.ops is not None and x.is_contiguous():
            return self.ops.rms_norm(x, w, eps)
        return F.rms_norm(x, self.hidden_shape, w, eps)

    def _decode_bias(self, attn: AttentionMetadata) -> torch.Tensor | None:
        """The matmul decode path's additive mask, one row per (row, KV head); None where decode rows
        read through SDPA (see MATMUL_ATTENTION_MIN_READ)."""
        nd, t, mask = attn.num_decode, attn.decode_len, attn.decode_mask
        if not (nd and attn.decode_index is not None and self.upcast_attention and nd * t >= MATMUL_ATTENTION_MIN_READ):
            return None
        assert mask is not None  # set with decode_index
        return torch.zeros(nd, 1, t, dtype=self.dtype, device=self.device).masked_fill_(
            ~mask.view(nd, 1, t), float("-inf")).expand(nd, self.kv_heads, t).reshape(
            nd * self.kv_heads, 1, t)

    def _layer(self, L: _Layer, h: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor | None,
               sin: torch.Tensor | None,
               kc: torch.Tensor, vc: torch.Tensor, attn: AttentionMetadata, bias: torch.Tensor | None,
               blocks: list[PrefillBlock], lora: tuple[LoraBatch, int] | None = None) -> torch.Tensor:
        x = self._norm(h, L.ln1, L.eps)
        H, KV, D = self.num_heads, self.kv_heads, self.head_dim
        qkv = self.gemm.linear(x, L.qkv, L.qkv_bias)
        if lora is not None:
            qkv = lora[0].apply(lora[1], "qkv", x, qkv)
        qkv = qkv.view(x.shape[0], H + 2 * KV, D)
        if self.ops is not None and L.q_norm is None:  # RoPE and the cache write in one pass
            self.ops.rope_and_cache(qkv, self.cos, self.sin_signed, positions, attn.slots, kc, vc, H)
            out = self._attention(qkv[:, :H], qkv[:, H : H + KV], qkv[:, H + KV :], kc, vc, attn, bias, blocks,
                                  written=True)
        else:
            assert cos is not None and sin is not None  # set wherever a layer has no fused RoPE (`torch_rope`)
            q, k, v = self._qkv(L, qkv, cos, sin)
            out = self._attention(q, k, v, kc, vc, attn, bias, blocks)
        h = self.gemm.linear_add(out, L.o, h) if L.o_bias is None else h + self.gemm.linear(out, L.o, L.o_bias)
        if lora is not None:  # an adapter row: (h + o(out)) + its update, the same bits whatever shares the step
            h = lora[0].apply(lora[1], "o", out, h)
        x = self._norm(h, L.ln2, L.eps)
        gate_up = self.gemm.linear(x, L.gate_up)
        if lora is not None:
            gate_up = lora[0].apply(lora[1], "gate_up", x, gate_up)
        if self.ops is not None and L.silu:
            act = self.ops.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = L.act(gate) * up
        h = self.gemm.linear_add(act, L.down, h)
        if lora is not None:
            h = lora[0].apply(lora[1], "down", act, h)
        return h

    def _qkv(self, L: _Layer, qkv: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """From the fused projection's output [N, H + 2 KV, D]: q [N, H, D], k and v [N, KV, D], with RoPE applied
        to q and k at once."""
        H, KV, D = self.num_heads, self.kv_heads, self.head_dim
        qk, v = qkv[:, : H + KV], qkv[:, H + KV :]
        if L.q_norm is not None:
            qk = torch.cat((F.rms_norm(qk[:, :H], (D,), L.q_norm, L.eps),
                            F.rms_norm(qk[:, H:], (D,), L.k_norm, L.eps)), dim=1)
        qk = torch.addcmul(qk * cos, qk.roll(D // 2, dims=-1), sin)
        return qk[:, :H], qk[:, H:], v

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                   attn: AttentionMetadata, bias: torch.Tensor | None, blocks: list[PrefillBlock],
                   written: bool = False) -> torch.Tensor:
        """Write k and v to their slots of the layer's cache (kc, vc: [KV, slots, D]) unless `written` already,
        then attend: [N, H * D]."""
        H, D = self.num_heads, self.head_dim
        if not written:
            kc.index_copy_(1, attn.slots, k.transpose(0, 1))
            vc.index_copy_(1, attn.slots, v.transpose(0, 1))
        kf, vf = kc.view(-1, D), vc.view(-1, D)  # [KV * slots, D]: what the gather indices address
        n_tok, nd, rows = q.shape[0], attn.num_decode, attn.decode_rows
        if rows is not None:
            o = self._paged_decode(q.index_select(0, rows), kc, vc, attn)
        elif nd:
            o = (self._paged_decode(q[:nd], kc, vc, attn) if attn.decode_tables is not None
                 else self._decode(q[:nd], kf, vf, attn, bias))
            if not attn.chunks:
                return o.reshape(n_tok, H * D)
        if attn.prefill_tables is not None or rows is not None:  # every chunk at once, read in place
            out = q.new_empty(n_tok, H, D)
            if attn.prefill_tables is not None:
                assert self.paged_prefill is not None  # the runner makes the tables only where the kernel loaded
                self.paged_prefill(q[nd:], kc, vc, attn.prefill_tables, self.block_size, out[nd:])
            if rows is not None:
                out.index_copy_(0, rows, o)
            elif nd:
                out[:nd] = o
            return out.view(n_tok, H * D)
        if attn.prefill is not None:
            o_pre = self._prefill_batch(q[nd:], kf, vf, attn.prefill, blocks)
            return (torch.cat((o, o_pre)) if nd else o_pre).view(n_tok, H * D)
        out = q.new_empty(n_tok, H, D)
        if nd:
            out[:nd] = o
        for chunk in attn.chunks:
            out[chunk.offset : chunk.offset + chunk.length] = self._prefill(q, k, v, kf, vf, chunk)
        return out.view(n_tok, H * D)

    def _paged_decode(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                      attn: AttentionMetadata) -> torch.Tensor:
        """The decode rows' attention, [rows, H, D], read in place by the paged decode kernel."""
        tables, lens = attn.decode_tables, attn.decode_lens
        assert self.paged_decode is not None and tables is not None and lens is not None  # set where the kernel loaded
        return self.paged_decode(q, kc, vc, tables, lens, self.block_size)

    def _decode(self, q: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, attn: AttentionMetadata,
                bias: torch.Tensor | None) -> torch.Tensor:
        """The decode rows' attention, [rows, H, D], over K/V gathered from the cache."""
        nd, KV, T, D = attn.num_decode, self.kv_heads, attn.decode_len, self.head_dim
        index, mask = attn.decode_index, attn.decode_mask
        assert index is not None and mask is not None  # set together where decode rows read a gathered copy
        return self.attend_decode(q, kf.index_select(0, index).view(nd, KV, T, D),
                                  vf.index_select(0, index).view(nd, KV, T, D), mask, bias)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor,
                 chunk: PrefillChunk) -> torch.Tensor:
        """One prefill chunk's attention, [n, H, D]."""
        p, n, off, idx = chunk
        qq = q[off : off + n].transpose(0, 1).unsqueeze(0)
        if idx is None:  # the chunk is all the sequence has: attend within it
            kk = k[off : off + n].transpose(0, 1).unsqueeze(0)
            vv = v[off : off + n].transpose(0, 1).unsqueeze(0)
            oc = self.attend(qq, kk, vv, is_causal=True)
        else:  # cached tokens before it: read them (and the chunk) from the cache
            kk = kf.index_select(0, idx).view(1, self.kv_heads, p + n, self.head_dim)
            vv = vf.index_select(0, idx).view(1, self.kv_heads, p + n, self.head_dim)
            mask = torch.arange(p + n, device=self.device)[None, :] <= torch.arange(
                p, p + n, device=self.device)[:, None]
            oc = self.attend(qq, kk, vv, attn_mask=mask)
        return oc[0].transpose(0, 1)

    def _prefill_blocks(self, pre: PrefillBatch) -> list[PrefillBlock]:
        """The padded prefill batch's blocks of PREFILL_BLOCK_ROWS query rows, each with the keys its rows read and
        the additive mask of those some of its rows must not see, built once a step for every layer (none where the
        fused causal softmax masks them itself)."""
        B, KV, G, T = len(pre.lengths), self.kv_heads, self.num_heads // self.kv_heads, pre.width
        out = []
        for s in range(0, pre.rows, PREFILL_BLOCK_ROWS):
            e = min(s + PREFILL_BLOCK_ROWS, pre.rows)
            keys = min(T, max(p + min(e, m) for p, m in zip(pre.starts, pre.lengths)))
            masked = min(pre.starts) + s  # a row at position p + i sees keys 0..p+i; p + s is the least of those
            bias = None
            if masked < keys and self.ops is None:
                blocked = pre.blocked[:, None, None, s:e, masked:keys].expand(B, KV, G, e - s, keys - masked)
                bias = torch.zeros(blocked.shape, dtype=self.dtype, device=self.device).masked_fill_(
                    blocked, float("-inf")).view(B * KV, G * (e - s), keys - masked)
            out.append(PrefillBlock(s, e, keys, masked, bias))
        return out

    def _prefill_batch(self, q: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, pre: PrefillBatch,
                       blocks: list[PrefillBlock]) -> torch.Tensor:
        """Every prefill chunk's attention at once, [prefill tokens, H, D]: queries padded to [chunks, rows], keys
        and values gathered from the cache, then per block of query rows (`blocks`) two batched matmuls over
        (chunk, KV head), each KV head's query group at once, reading only the keys the block's rows can see
        (a first chunk skips those past the block), a softmax between. On CPU in half precision, where this
        runs on oneDNN's bf16 matmuls and torch's CPU flash attention needs float32 (upcast): about half its
        time at ~500-token prompts."""
        B, R, T = len(pre.lengths), pre.rows, pre.width
        H, KV, D = self.num_heads, self.kv_heads, self.head_dim
        G = H // KV
        qp = q.new_zeros(B * R, H, D).index_copy_(0, pre.pad_rows, q)
        qg = qp.view(B, R, KV, G, D).permute(0, 2, 3, 1, 4)  # [B, KV, G, R, D]
        kt = kf.index_select(0, pre.index).view(B * KV, T, D).transpose(1, 2)  # [B * KV, D, T]
        vv = vf.index_select(0, pre.index).view(B * KV, T, D)
        out = q.new_empty(B, KV, G, R, D)
        unused = q.new_empty(1, 1, 1)  # baddbmm with beta=0: the scale folded into the matmul
        for s, e, keys, masked, bias in blocks:
            scores = torch.baddbmm(unused, qg[:, :, :, s:e].reshape(B * KV, G * (e - s), D), kt[:, :, :keys], beta=0,
                                   alpha=D**-0.5)
            if self.ops is not None:  # the mask and the softmax in one pass, each row only over the keys it sees
                probs = self.ops.causal_softmax_(scores, pre.first, s, KV, G)
            else:
                if bias is not None:
                    scores[:, :, masked:].add_(bias)
                probs = torch.softmax(scores, dim=-1)
            out[:, :, :, s:e] = torch.bmm(probs, vv[:, :keys]).view(B, KV, G, e - s, D)
        return out.permute(0, 3, 1, 2, 4).reshape(B * R, H, D).index_select(0, pre.pad_rows)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
               is_causal: bool = False) -> torch.Tensor:
        """SDPA; on CPU in half precision, computed in float32: torch's CPU flash attention is ~4x
        slower in bfloat16 than in float32 at decode shapes (a decode step at 32 rows: 36 ms of
        attention against 9 ms), and the upcast of q, K and V costs less than the difference."""
        if self.upcast_attention:
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=attn_mask,
                                                  is_causal=is_causal, enable_gqa=True).to(self.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=True)

    def attend_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        """One query per decode row: q [rows, H, D] against K/V gathered from the cache as [rows, KV, T, D];
        out [rows, H, D]. On CPU in half precision: two batched matmuls over (row, KV head), each KV head's
        query group at once, softmax in float32 (`bias` masks padding): no upcast copies and about half of
        SDPA's time there. Elsewhere, and for small reads (`bias` None): SDPA over the same gathered K/V."""
        rows, H, D = q.shape
        if bias is None:
            return self.attend(q.unsqueeze(2), k, v, attn_mask=mask).reshape(rows, H, D)
        _, KV, T, _ = k.shape
        qg = q.reshape(rows * KV, H // KV, D)
        scores = torch.baddbmm(bias, qg, k.view(rows * KV, T, D).transpose(1, 2), alpha=D**-0.5)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.bmm(probs, v.view(rows * KV, T, D)).view(rows, H, D)
