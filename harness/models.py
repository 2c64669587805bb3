"""The tiny model: a randomly initialised Llama of the default model's shape family with the real tokenizer,
for tests and `--quick` benchmark runs where a real forward pass matters but its quality does not."""

from __future__ import annotations

import shutil
from pathlib import Path


def make_tiny_model(out: Path, tokenizer_from: str, seed: int = 0, hidden_size: int = 64) -> str:
    """A randomly initialised Llama of the default model's shape family, tiny, with the real tokenizer
    (copied from `tokenizer_from`): what the tests and every `--quick` run use. Its LM head is its own
    (not the embeddings, as in the default model): tied random weights make every prompt's greedy
    continuation repeat the last token, which would hide any mix-up between jobs. Another `seed` (and
    `hidden_size`) makes another checkpoint, for a deployment serving several models."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=49152, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(tokenizer_from) / name).exists():
            shutil.copy(Path(tokenizer_from) / name, out / name)
    return str(out)


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_lora_adapter(out: Path, base_dir: str, seed: int, r: int = 8, alpha: int = 16, scale: float = 1.0,
                      **config: object) -> str:
    """A PEFT LoRA adapter of the model at `base_dir`, saved as PEFT saves one (adapter_config.json and
    adapter_model.safetensors), with random A and B (`init_lora_weights=False`: a fresh adapter's B is zero, and
    would change nothing), B scaled by `scale`. `config`: more LoraConfig fields (target_modules, rank_pattern,
    alpha_pattern, use_rslora, ...); every attention and MLP projection by default."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    lora = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, init_lora_weights=False,
                      **{"target_modules": LORA_TARGETS, **config})  # type: ignore[arg-type]
    model = get_peft_model(base, lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(scale)
    model.save_pretrained(out)
    return str(out)
