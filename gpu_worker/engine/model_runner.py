"""Runs one engine step through a Llama-family model over a flat token batch.

The linear layers see every scheduled token at once (decode rows and prefill chunks
together, no padding). Attention reads the slot KV cache: decode rows in one batched call
over a dense view, prefill chunks one by one with a causal mask offset by what is cached.
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
from gpu_worker.engine.kv_cache import KVCache
from gpu_worker.engine.step import StepBatch

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
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
                 max_model_len: int = 0, model: torch.nn.Module | None = None) -> None:
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
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
        self.cache = KVCache(len(self.layers), self.kv_heads, self.head_dim, self.max_model_len,
                             self.dtype, self.device)
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

    @torch.inference_mode()
    def run(self, batch: StepBatch) -> torch.Tensor:
        """Compute the scheduled tokens; return float32 logits for every sequence that reaches
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

        dec_rows = [s.slot for s in decode]
        dense = dec_rows == list(range(nd))
        dec_rows_t = self._to_device(dec_rows) if nd else None
        dec_pos_t = pos_t[:nd]
        t_dec = max((p + 1 for p in pos[:nd]), default=0)
        dec_mask = None
        if nd:
            # flat row index of (slot, head, position) in a layer's [rows * heads * capacity, head_dim] view
            cap = self.cache.capacity
            heads = torch.arange(self.kv_heads, device=self.device)
            dec_flat = ((dec_rows_t[:, None] * self.kv_heads + heads[None, :]) * cap + dec_pos_t[:, None]).reshape(-1)
            lengths = dec_pos_t + 1
            dec_mask = (torch.arange(t_dec, device=self.device)[None, :] < lengths[:, None]).view(nd, 1, 1, t_dec)
        chunk_meta = []  # (row, start, n, offset, mask)
        off = nd
        for s, n in chunks:
            p = s.num_computed
            q_pos = torch.arange(p, p + n, device=self.device)[:, None]
            mask = torch.arange(p + n, device=self.device)[None, :] <= q_pos
            chunk_meta.append((s.slot, p, n, off, mask))
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
            kc, vc = self.cache.k[li], self.cache.v[li]
            if nd:  # scatter each decode row's new K/V into its slot: a flat index_copy_, no index_put
                kc.view(-1, D).index_copy_(0, dec_flat, k[:nd].reshape(-1, D))
                vc.view(-1, D).index_copy_(0, dec_flat, v[:nd].reshape(-1, D))
                if dense:
                    kk, vv = kc[:nd, :, :t_dec], vc[:nd, :, :t_dec]
                else:
                    kk = kc.index_select(0, dec_rows_t)[:, :, :t_dec]
                    vv = vc.index_select(0, dec_rows_t)[:, :, :t_dec]
                o = F.scaled_dot_product_attention(q[:nd].unsqueeze(2), kk, vv, attn_mask=dec_mask, enable_gqa=True)
            if pure_decode:
                out = o.view(n_tok, H * D)
            else:
                out = q.new_empty(n_tok, H, D)
                if nd:
                    out[:nd] = o.squeeze(2)
                for row, p, n, o_off, mask in chunk_meta:
                    kc[row, :, p : p + n] = k[o_off : o_off + n].transpose(0, 1)
                    vc[row, :, p : p + n] = v[o_off : o_off + n].transpose(0, 1)
                    qq = q[o_off : o_off + n].transpose(0, 1).unsqueeze(0)
                    oc = F.scaled_dot_product_attention(qq, kc[row : row + 1, :, : p + n],
                                                        vc[row : row + 1, :, : p + n], attn_mask=mask, enable_gqa=True)
                    out[o_off : o_off + n] = oc[0].transpose(0, 1)
                out = out.view(n_tok, H * D)
            h = self.gemm.linear_add(out, L.o, h) if L.o_bias is None else h + self.gemm.linear(out, L.o, L.o_bias)
            gate, up = self.gemm.linear(F.rms_norm(h, self.hidden_shape, L.ln2, L.eps), L.gate_up).chunk(2, dim=-1)
            h = self.gemm.linear_add(L.act(gate) * up, L.down, h)

        sample_rows = list(range(nd))
        for (s, n), (_, _, _, o_off, _) in zip(chunks, chunk_meta):
            if s.num_computed + n == s.num_tokens:
                sample_rows.append(o_off + n - 1)
        if not sample_rows:
            return torch.empty(0, self.vocab_size)
        if len(sample_rows) < n_tok:  # a pure decode step samples every row, in order
            h = h.index_select(0, self._to_device(sample_rows))
        h = F.rms_norm(h, self.hidden_shape, self.norm_w, self.norm_eps)
        return self.head_gemm.linear(h, self.lm_head_w).float()
