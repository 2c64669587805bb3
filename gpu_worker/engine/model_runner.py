"""Runs one engine step through a Llama-family model over a flat token batch.

The linear layers see every scheduled token at once (decode rows and prefill chunks
together, no padding). Attention reads the slot KV cache: decode rows in one batched call
over a dense view, prefill chunks one by one with a causal mask offset by what is cached.
Works for Llama, Mistral, Qwen2/3, SmolLM and other models with the same layer shape.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_worker.engine.kv_cache import KVCache
from gpu_worker.engine.sequence import Sequence

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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass
class StepBatch:
    decode: list[Sequence]  # each computes exactly one token: its last
    chunks: list[tuple[Sequence, int]]  # (sequence, tokens to compute), more than one each

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(n for _, n in self.chunks)


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
        self.layers = list(inner.layers)
        self.embed, self.norm, self.lm_head = inner.embed_tokens, inner.norm, self.model.lm_head
        self.eos_token_ids = self._eos_ids()
        with torch.inference_mode():
            pos = torch.arange(self.max_model_len, device=self.device)[None]
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = inner.rotary_emb(probe, pos)
            self.cos, self.sin = cos[0], sin[0]  # [max_len, head_dim]
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
        cos, sin = self.cos[pos_t].unsqueeze(1), self.sin[pos_t].unsqueeze(1)  # [N, 1, D]

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

        h = self.embed(ids_t)
        for li, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(n_tok, self.num_heads, self.head_dim)
            k = attn.k_proj(x).view(n_tok, self.kv_heads, self.head_dim)
            v = attn.v_proj(x).view(n_tok, self.kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            kc, vc = self.cache.k[li], self.cache.v[li]
            out = torch.empty_like(q)
            if nd:  # scatter each decode row's new K/V into its slot: a flat index_copy_, no index_put
                kc.view(-1, self.head_dim).index_copy_(0, dec_flat, k[:nd].reshape(-1, self.head_dim))
                vc.view(-1, self.head_dim).index_copy_(0, dec_flat, v[:nd].reshape(-1, self.head_dim))
                if dense:
                    kk, vv = kc[:nd, :, :t_dec], vc[:nd, :, :t_dec]
                else:
                    kk = kc.index_select(0, dec_rows_t)[:, :, :t_dec]
                    vv = vc.index_select(0, dec_rows_t)[:, :, :t_dec]
                o = F.scaled_dot_product_attention(q[:nd].unsqueeze(2), kk, vv, attn_mask=dec_mask, enable_gqa=True)
                out[:nd] = o.squeeze(2)
            for row, p, n, o_off, mask in chunk_meta:
                kc[row, :, p : p + n] = k[o_off : o_off + n].transpose(0, 1)
                vc[row, :, p : p + n] = v[o_off : o_off + n].transpose(0, 1)
                qq = q[o_off : o_off + n].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qq, kc[row : row + 1, :, : p + n], vc[row : row + 1, :, : p + n],
                                                   attn_mask=mask, enable_gqa=True)
                out[o_off : o_off + n] = o[0].transpose(0, 1)
            h = h + attn.o_proj(out.view(n_tok, self.num_heads * self.head_dim))
            h = h + layer.mlp(layer.post_attention_layernorm(h))

        sample_rows = list(range(nd))
        for (s, n), (_, _, _, o_off, _) in zip(chunks, chunk_meta):
            if s.num_computed + n == s.num_tokens:
                sample_rows.append(o_off + n - 1)
        if not sample_rows:
            return torch.empty(0, self.vocab_size)
        idx = self._to_device(sample_rows)
        return self.lm_head(self.norm(h.index_select(0, idx))).float()
