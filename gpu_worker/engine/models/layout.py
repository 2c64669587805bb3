"""The attribute tree `Llama` takes over, as read-only protocols: a transformers Llama-family model
(`LlamaForCausalLM` and its kin) or the same tree read straight from a checkpoint (checkpoint.py) satisfies
them. `Llama` reads nothing of the model that is not named here, but for what some layouts have and others
do not (q/k norms, the norms' epsilon, the config's optional sizes), read with `getattr` and `hasattr`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch


class Weighted(Protocol):
    """An embedding, a norm or the LM head: what `Llama` reads of it is its weight."""

    @property
    def weight(self) -> torch.Tensor: ...


class Linear(Weighted, Protocol):
    @property
    def bias(self) -> torch.Tensor | None: ...


class Activation(Protocol):
    def __call__(self, x: torch.Tensor, /) -> torch.Tensor: ...


class Attention(Protocol):
    @property
    def q_proj(self) -> Linear: ...
    @property
    def k_proj(self) -> Linear: ...
    @property
    def v_proj(self) -> Linear: ...
    @property
    def o_proj(self) -> Linear: ...


class MLP(Protocol):
    @property
    def gate_proj(self) -> Linear: ...
    @property
    def up_proj(self) -> Linear: ...
    @property
    def down_proj(self) -> Linear: ...
    @property
    def act_fn(self) -> Activation: ...


class DecoderLayer(Protocol):
    @property
    def self_attn(self) -> Attention: ...
    @property
    def mlp(self) -> MLP: ...
    @property
    def input_layernorm(self) -> Weighted: ...
    @property
    def post_attention_layernorm(self) -> Weighted: ...


class RotaryEmbedding(Protocol):
    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor, /) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin per position, [1, positions, head_dim], in x's dtype."""
        ...


class Decoder(Protocol):
    @property
    def embed_tokens(self) -> Weighted: ...
    @property
    def layers(self) -> Iterable[DecoderLayer]: ...
    @property
    def norm(self) -> Weighted: ...
    @property
    def rotary_emb(self) -> RotaryEmbedding: ...


class Config(Protocol):
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...


class CausalLM(Protocol):
    """The model as a whole: its config, its decoder and its LM head, and the dtype its weights are in."""

    @property
    def config(self) -> Config: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def model(self) -> Decoder: ...
    @property
    def lm_head(self) -> Weighted: ...
