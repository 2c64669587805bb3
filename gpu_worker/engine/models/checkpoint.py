"""A Llama-family checkpoint read straight from its files (config.json, *.safetensors), without transformers.

Importing transformers' model code costs a new inference worker ~3 CPU-s (its modeling module pulls in
torch._dynamo and torch.distributed.tensor), more than loading a small model's weights. For the layouts `Llama`
runs (llama, mistral, qwen2, qwen3: SiLU MLP, RMSNorm, default RoPE) the checkpoint is read here into the
attribute tree `Llama` takes over (`model.layers[i].self_attn.q_proj.weight`, ...), with transformers' own RoPE
arithmetic. Anything else (RoPE scaling, another activation, no safetensors) returns None, and the runner loads
the model through transformers as before.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from shared.model_config import ENGINE_ARCHS


class _Rope:
    """transformers' default rotary embedding: cos and sin per position, [1, positions, head_dim], computed in
    float32 and cast to the probe's dtype, as `LlamaRotaryEmbedding` does."""

    def __init__(self, theta: float, dim: int, device: torch.device) -> None:
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = (self.inv_freq[None, :, None].float() @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _rope_theta(cfg: dict[str, Any]) -> float | None:
    """The RoPE base when the checkpoint uses plain RoPE (no scaling), else None."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):  # transformers 5's layout
        return float(params["rope_theta"]) if params.get("rope_type", "default") == "default" else None
    scaling = cfg.get("rope_scaling")
    if scaling and (scaling.get("rope_type") or scaling.get("type")) != "default":
        return None
    return float(cfg.get("rope_theta", 10000.0))


def _tensors(path: Path, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor] | None:
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        return None
    out: dict[str, torch.Tensor] = {}
    for name in files:
        out.update((k, v.to(device=device, dtype=dtype)) for k, v in load_file(str(path / name)).items())
    return out


def load_checkpoint(model_dir: str, dtype: torch.dtype, device: torch.device) -> SimpleNamespace | None:
    """The checkpoint as the attribute tree `Llama` takes over, in `dtype` on `device`; None when this reader
    does not handle it (the caller then loads it through transformers)."""
    path = Path(model_dir)
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    theta = _rope_theta(cfg)
    if (cfg.get("model_type") not in ENGINE_ARCHS or cfg.get("hidden_act", "silu") != "silu" or theta is None
            or cfg.get("partial_rotary_factor", 1.0) != 1.0 or cfg.get("quantization_config") or cfg.get("mlp_bias")):
        return None
    tensors = _tensors(path, dtype, device)
    if tensors is None:
        return None
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    eps = cfg.get("rms_norm_eps", 1e-6)

    def linear(prefix: str) -> SimpleNamespace:
        return SimpleNamespace(weight=tensors[f"{prefix}.weight"], bias=tensors.get(f"{prefix}.bias"))

    def norm(name: str) -> SimpleNamespace:
        return SimpleNamespace(weight=tensors[name], variance_epsilon=eps)

    layers = []
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        attn = SimpleNamespace(**{n: linear(f"{p}.self_attn.{n}") for n in ("q_proj", "k_proj", "v_proj", "o_proj")})
        if f"{p}.self_attn.q_norm.weight" in tensors:  # qwen3: RMSNorm per head on q and k
            attn.q_norm, attn.k_norm = norm(f"{p}.self_attn.q_norm.weight"), norm(f"{p}.self_attn.k_norm.weight")
        mlp = SimpleNamespace(act_fn=F.silu, **{n: linear(f"{p}.mlp.{n}")
                                                for n in ("gate_proj", "up_proj", "down_proj")})
        layers.append(SimpleNamespace(self_attn=attn, mlp=mlp, input_layernorm=norm(f"{p}.input_layernorm.weight"),
                                      post_attention_layernorm=norm(f"{p}.post_attention_layernorm.weight")))
    embed = tensors["model.embed_tokens.weight"]
    head = tensors.get("lm_head.weight", embed) if not cfg.get("tie_word_embeddings", False) else embed
    generation = path / "generation_config.json"
    config = SimpleNamespace(**cfg)
    config.head_dim = head_dim
    return SimpleNamespace(
        config=config, dtype=dtype, name_or_path=str(path),
        generation_config=SimpleNamespace(**json.loads(generation.read_text())) if generation.is_file() else None,
        lm_head=SimpleNamespace(weight=head),
        model=SimpleNamespace(embed_tokens=SimpleNamespace(weight=embed), layers=layers,
                              norm=norm("model.norm.weight"), rotary_emb=_Rope(theta, head_dim, device)))
