"""The tiny model: a randomly initialised Llama of the default model's shape family with the real tokenizer,
for tests and `--quick` benchmark runs where a real forward pass matters but its quality does not."""

from __future__ import annotations

import shutil
from pathlib import Path


def make_tiny_model(out: Path, tokenizer_from: str) -> str:
    """A randomly initialised Llama of the default model's shape family, tiny, with the real tokenizer
    (copied from `tokenizer_from`): what the tests and every `--quick` run use. Its LM head is its own
    (not the embeddings, as in the default model): tied random weights make every prompt's greedy
    continuation repeat the last token, which would hide any mix-up between jobs."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(tokenizer_from) / name).exists():
            shutil.copy(Path(tokenizer_from) / name, out / name)
    return str(out)
