"""Runs one engine step through a Llama-family model over a flat token batch.

The linear layers see every scheduled token at once (decode rows and prefill chunks
together, no padding). Every new token's K/V is written to its slot of the paged cache in one
call per layer; decode rows then read their blocks (gathered to a common length, the null block
as padding) in one batched attention call, and prefill chunks attend one by one, over the cache
when tokens before them are cached, over themselves when they start the sequence.
Works for Llama, Mistral, Qwen2/3, SmolLM and other models with the same layer shape.

The runner takes over the model it is given: q/k/v and gate/up weights are concatenated into one
matrix each (the model's parameters become views of it), and where the GEMM backend keeps its own
layout (oneDNN on CPU in bfloat16) the model's layer matrices are emptied.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_worker.engine.gemm import Gemm, choose_gemm
from gpu_worker.engine.host_memory import keep_freed_memory
from gpu_worker.engine.kv_cache import KVCache, bytes_per_token
from gpu_worker.engine.step import StepBatch
from shared.model_config import checkpoint_dtype

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# Decode attention in half precision on CPU: batched matmuls once the rows read this many cached tokens
# in all (per KV head), SDPA computed in float32 below that. Per layer, 100 tokens a row: 1 row 21 us
# SDPA / 40 us matmuls, 4 rows 41 / 45, 8 rows 68 / 54; 400 tokens a row: 1 row 38 / 45, 2 rows 56 / 50
# (`python -m bench.attention`, BENCHMARKS.md).
MATMUL_ATTENTION_MIN_READ = 600


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX), as oneDNN reports it."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(torch.backends.mkldnn.is_available() and check is not None and check())


def resolve_dtype(name: str, device: torch.device, checkpoint: torch.dtype | None = None) -> torch.dtype:
    """`auto`, as vLLM does: the checkpoint's half-precision dtype where the device computes it, with
    float32 checkpoints run in bfloat16 there; float32 on CPUs without native bfloat16."""
    if name == "auto":
        if device.type == "cuda":
            return checkpoint if checkpoint in (torch.bfloat16, torch.float16) else torch.bfloat16
        if checkpoint == torch.float16:
            return torch.float32  # fp16 on CPU is slow where it is not native; fp32 holds it exactly
        return torch.bfloat16 if cpu_has_bf16() else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[name]


@dataclass
class _Layer:
    """One decoder layer's weights, with q/k/v and gate/up fused into single matrices; the four
    matrices are held as the GEMM backend prepared them (a tensor, or a backend-specific form)."""
    ln1: torch.Tensor
    ln2: torch.Tensor
    eps: float
    qkv: object
    qkv_bias: torch.Tensor | None
    o: object
    o_bias: torch.Tensor | None
    gate_up: object
    down: object
    act: object
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


def _fuse(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of linears that read the same input, then point each
    linear's parameters at its slice of the result, so the model holds no second copy."""
    weight = torch.cat([m.weight.detach() for m in linears])
    has_bias = [m.bias is not None for m in linears]
    bias = torch.cat([m.bias.detach() for m in linears]) if all(has_bias) else None
    if any(has_bias) and bias is None:
        raise ValueError("cannot fuse linears where only some have a bias")
    at = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = weight[at : at + n]
        if bias is not None:
            m.bias.data = bias[at : at + n]
        at += n
    return weight, bias


def _eps(norm: torch.nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", None) or norm.eps)


def _layer_weights(layer: torch.nn.Module, gemm: Gemm) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp
    qkv, qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
    gate_up, _ = _fuse([mlp.gate_proj, mlp.up_proj])
    if mlp.gate_proj.bias is not None or mlp.down_proj.bias is not None:
        raise ValueError("MLP biases are not supported")
    weights = _Layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, _eps(layer.input_layernorm),
                     gemm.prepare(qkv), qkv_bias, gemm.prepare(attn.o_proj.weight), attn.o_proj.bias,
                     gemm.prepare(gate_up), gemm.prepare(mlp.down_proj.weight), mlp.act_fn,
                     attn.q_norm.weight if hasattr(attn, "q_norm") else None,
                     attn.k_norm.weight if hasattr(attn, "k_norm") else None)
    if gemm.copies_weights:  # the runner now owns these layers' matrices: keep one copy, not two
        for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            m.weight.data = m.weight.data.new_empty(0)
    return weights


class ModelRunner:
    def __init__(self, model_path: str, device: str = "auto", dtype: str = "auto",
                 max_model_len: int = 0, model: torch.nn.Module | None = None, kv_cache_mb: int = 2048,
                 block_size: int = 16, max_cache_tokens: int = 0) -> None:
        self.device = resolve_device(device)
        if self.device.type == "cpu":
            keep_freed_memory()  # each step's temporaries: see host_memory.py
        own = model.dtype if model is not None else DTYPES.get(checkpoint_dtype(model_path) or "")
        self.dtype = resolve_dtype(dtype, self.device, own)
        if model is None:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        cfg = self.model.config
        self.config = cfg
        self.num_heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.vocab_size = cfg.vocab_size
        own_max = getattr(cfg, "max_position_embeddings", 4096)
        self.max_model_len = min(max_model_len, own_max) if max_model_len > 0 else own_max
        inner = self.model.model
        self.gemm, self.head_gemm = choose_gemm(self.device, self.dtype)
        with torch.no_grad():
            self.layers = [_layer_weights(layer, self.gemm) for layer in inner.layers]
            self.lm_head_w = self.head_gemm.prepare(self.model.lm_head.weight)
        self.embed_w = inner.embed_tokens.weight
        self.norm_w = inner.norm.weight
        self.norm_eps = _eps(inner.norm)
        self.hidden_shape = (cfg.hidden_size,)
        self.eos_token_ids = self._eos_ids()
        with torch.inference_mode():
            pos = torch.arange(self.max_model_len, device=self.device)[None]
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = inner.rotary_emb(probe, pos)
            # RoPE as x * cos + roll(x, D/2) * sin_signed: rotate_half(x) * sin with the sign moved onto sin
            half = self.head_dim // 2
            self.cos = cos[0]  # [max_len, head_dim]
            self.sin_signed = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)
        # the KV pool: the budget's worth of blocks, at most `max_cache_tokens` (plus the null block)
        per_block = bytes_per_token(len(self.layers), self.kv_heads, self.head_dim, self.dtype) * block_size
        num_blocks = max(2, kv_cache_mb * 2**20 // per_block)
        if max_cache_tokens > 0:
            num_blocks = min(num_blocks, -(-max_cache_tokens // block_size) + 1)
        self.block_size = block_size
        self.cache = KVCache(len(self.layers), self.kv_heads, self.head_dim, num_blocks, block_size,
                             self.dtype, self.device)
        self._block_offsets = torch.arange(block_size, device=self.device)
        # a layer's K (or V) seen as [KV * slots, D]: head h's slot s is row h * slots + s
        self._head_offsets = torch.arange(self.kv_heads, device=self.device)[None, :, None] * (num_blocks * block_size)
        self._upcast_attention = self.device.type == "cpu" and self.dtype != torch.float32
        self._pin = self.device.type == "cuda"

    def _eos_ids(self) -> tuple[int, ...]:
        ids: set[int] = set()
        for src in (getattr(self.model, "generation_config", None), self.config):
            eos = getattr(src, "eos_token_id", None) if src is not None else None
            if isinstance(eos, int):
                ids.add(eos)
            elif eos:
                ids.update(int(e) for e in eos)
        return tuple(sorted(ids))

    def _to_device(self, values: list[int]) -> torch.Tensor:
        t = torch.tensor(values, dtype=torch.long)
        if self._pin:
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object) -> torch.Tensor:
        """SDPA; on CPU in half precision, computed in float32: torch's CPU flash attention is ~4x
        slower in bfloat16 than in float32 at decode shapes (a decode step at 32 rows: 36 ms of
        attention against 9 ms), and the upcast of q, K and V costs less than the difference."""
        if self._upcast_attention:
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True,
                                                  **kw).to(self.dtype)  # type: ignore[arg-type]
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)  # type: ignore[arg-type]

    def _attend_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
        """One query per decode row: q [rows, H, D] against K/V gathered from the cache as [rows, KV, T, D];
        out [rows, H, D]. On CPU in half precision: two batched matmuls over (row, KV head), each KV head's
        query group at once, softmax in float32 (`bias` masks padding): no upcast copies and about half of
        SDPA's time there. Elsewhere, and for small reads (`bias` None): SDPA over the same gathered K/V."""
        rows, H, D = q.shape
        if bias is None:
            return self._attend(q.unsqueeze(2), k, v, attn_mask=mask).reshape(rows, H, D)
        _, KV, T, _ = k.shape
        qg = q.reshape(rows * KV, H // KV, D)
        scores = torch.baddbmm(bias, qg, k.view(rows * KV, T, D).transpose(1, 2), alpha=D**-0.5)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.bmm(probs, v.view(rows * KV, T, D)).view(rows, H, D)

    def _slots(self, decode: list, chunks: list) -> list[int]:
        bs = self.block_size
        out = []
        for s in decode:
            p = s.num_computed
            out.append(s.block_table[p // bs] * bs + p % bs)
        for s, n in chunks:
            table = s.block_table
            out.extend(table[p // bs] * bs + p % bs for p in range(s.num_computed, s.num_computed + n))
        return out

    def _gather_index(self, tables: list[list[int]], lengths: torch.Tensor, width: int) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor]:
        """Flat index [rows * KV * width] into a layer's K or V seen as [KV * slots, D], reading each row's
        first `width` tokens per head (the null block past its length): one index_select gives them
        as a contiguous [rows, KV, width, D]. And the [rows, 1, 1, width] mask of the row's own positions."""
        bs = self.block_size
        nblk = -(-width // bs)
        table = torch.tensor([t[:nblk] + [0] * (nblk - len(t[:nblk])) for t in tables], dtype=torch.long)
        table = table.to(self.device)
        idx = (table[:, :, None] * bs + self._block_offsets[None, None, :]).view(len(tables), -1)[:, :width]
        mask = torch.arange(width, device=self.device)[None, :] < lengths[:, None]
        idx = torch.where(mask, idx, 0)
        return (idx[:, None, :] + self._head_offsets).reshape(-1), mask.view(len(tables), 1, 1, width)

    @torch.inference_mode()
    def run(self, batch: StepBatch) -> torch.Tensor:
        """Compute the scheduled tokens; return logits (in the model's dtype) for every sequence that reaches
        its end this step: the decode rows first, then completed chunks, in order."""
        decode, chunks = batch.decode, batch.chunks
        nd = len(decode)
        ids: list[int] = [s.token_ids[s.num_computed] for s in decode]
        pos: list[int] = [s.num_computed for s in decode]
        for s, n in chunks:
            ids.extend(s.token_ids[s.num_computed : s.num_computed + n])
            pos.extend(range(s.num_computed, s.num_computed + n))
        n_tok = len(ids)
        ids_t, pos_t = self._to_device(ids), self._to_device(pos)
        cos, sin = self.cos[pos_t].unsqueeze(1), self.sin_signed[pos_t].unsqueeze(1)  # [N, 1, D]

        slots_t = self._to_device(self._slots(decode, chunks))  # where each token's K/V is written
        t_dec = max((p + 1 for p in pos[:nd]), default=0)
        dec_idx = dec_mask = dec_bias = None
        if nd:  # each decode row reads its first t_dec slots; past its length, the null block
            dec_idx, dec_mask = self._gather_index([s.block_table for s in decode], pos_t[:nd] + 1, t_dec)
            if self._upcast_attention and nd * t_dec >= MATMUL_ATTENTION_MIN_READ:
                # the matmul path's additive mask, one row per (row, KV head)
                dec_bias = torch.zeros(nd, 1, t_dec, dtype=self.dtype, device=self.device).masked_fill_(
                    ~dec_mask.view(nd, 1, t_dec), float("-inf")).expand(nd, self.kv_heads, t_dec).reshape(
                    nd * self.kv_heads, 1, t_dec)
        chunk_meta = []  # (start, n, offset, gather index or None when the chunk starts the sequence)
        off = nd
        for s, n in chunks:
            p = s.num_computed
            idx = None
            if p:
                idx, _ = self._gather_index([s.block_table], torch.tensor([p + n], device=self.device), p + n)
            chunk_meta.append((p, n, off, idx))
            off += n

        h = F.embedding(ids_t, self.embed_w)
        H, KV, D = self.num_heads, self.kv_heads, self.head_dim
        pure_decode = not chunk_meta
        for li, L in enumerate(self.layers):
            x = F.rms_norm(h, self.hidden_shape, L.ln1, L.eps)
            qkv = self.gemm.linear(x, L.qkv, L.qkv_bias).view(n_tok, H + 2 * KV, D)
            qk, v = qkv[:, : H + KV], qkv[:, H + KV :]
            if L.q_norm is not None:
                qk = torch.cat((F.rms_norm(qk[:, :H], (D,), L.q_norm, L.eps),
                                F.rms_norm(qk[:, H:], (D,), L.k_norm, L.eps)), dim=1)
            qk = torch.addcmul(qk * cos, qk.roll(D // 2, dims=-1), sin)  # RoPE on q and k at once
            q, k = qk[:, :H], qk[:, H:]
            kc, vc = self.cache.k[li], self.cache.v[li]  # [KV, slots, D]
            kc.index_copy_(1, slots_t, k.transpose(0, 1))
            vc.index_copy_(1, slots_t, v.transpose(0, 1))
            kf, vf = kc.view(-1, D), vc.view(-1, D)  # [KV * slots, D]: what the gather indices address
            if nd:
                o = self._attend_decode(q[:nd], kf.index_select(0, dec_idx).view(nd, KV, t_dec, D),
                                        vf.index_select(0, dec_idx).view(nd, KV, t_dec, D), dec_mask, dec_bias)
            if pure_decode:
                out = o.reshape(n_tok, H * D)
            else:
                out = q.new_empty(n_tok, H, D)
                if nd:
                    out[:nd] = o
                for p, n, o_off, idx in chunk_meta:
                    qq = q[o_off : o_off + n].transpose(0, 1).unsqueeze(0)
                    if idx is None:  # the chunk is all the sequence has: attend within it
                        kk = k[o_off : o_off + n].transpose(0, 1).unsqueeze(0)
                        vv = v[o_off : o_off + n].transpose(0, 1).unsqueeze(0)
                        oc = self._attend(qq, kk, vv, is_causal=True)
                    else:  # cached tokens before it: read them (and the chunk) from the cache
                        kk = kf.index_select(0, idx).view(1, KV, p + n, D)
                        vv = vf.index_select(0, idx).view(1, KV, p + n, D)
                        mask = torch.arange(p + n, device=self.device)[None, :] <= torch.arange(
                            p, p + n, device=self.device)[:, None]
                        oc = self._attend(qq, kk, vv, attn_mask=mask)
                    out[o_off : o_off + n] = oc[0].transpose(0, 1)
                out = out.view(n_tok, H * D)
            h = self.gemm.linear_add(out, L.o, h) if L.o_bias is None else h + self.gemm.linear(out, L.o, L.o_bias)
            gate, up = self.gemm.linear(F.rms_norm(h, self.hidden_shape, L.ln2, L.eps), L.gate_up).chunk(2, dim=-1)
            h = self.gemm.linear_add(L.act(gate) * up, L.down, h)

        sample_rows = list(range(nd))
        for (s, n), (_, _, o_off, _) in zip(chunks, chunk_meta):
            if s.num_computed + n == s.num_tokens:
                sample_rows.append(o_off + n - 1)
        if not sample_rows:
            return torch.empty(0, self.vocab_size)
        if len(sample_rows) < n_tok:  # a pure decode step samples every row, in order
            h = h.index_select(0, self._to_device(sample_rows))
        h = F.rms_norm(h, self.hidden_shape, self.norm_w, self.norm_eps)
        return self.head_gemm.linear(h, self.lm_head_w)  # the sampler upcasts only the rows it samples
