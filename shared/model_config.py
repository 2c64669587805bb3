"""What the stages read from a model's `config.json` without loading the model: its vocabulary
size (the API's bounds on token ids), the context it serves (the tokenizer's length check,
the API's `max_model_len`), the dtype its weights were saved in (the engine's DTYPE=auto), and the ids that
end a generation (`eos_ids`: the engine and the grammar compiler read them alike)."""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# the architectures (config.json's model_type) whose arithmetic the engine computes (gpu_worker/engine/models/llama.py)
ENGINE_ARCHS = ("llama", "mistral", "qwen2", "qwen3")


@lru_cache(maxsize=8)
def model_config(model_dir: str) -> dict[str, Any]:
    """The model's config.json ({} when there is none to read)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        return cfg if isinstance(cfg, dict) else {}
    except (OSError, ValueError):
        log.warning("no readable config.json in %s", model_dir)
        return {}


def _int_field(cfg: dict[str, Any], name: str) -> int | None:
    value = cfg.get(name) or (cfg.get("text_config") or {}).get(name)
    return int(value) if isinstance(value, int) and value > 0 else None


def vocab_size(model_dir: str) -> int | None:
    return _int_field(model_config(model_dir), "vocab_size")


def model_context(model_dir: str, cap: int) -> int:
    """The context served: the model's own, capped by MAX_MODEL_LEN (0: no cap)."""
    own = _int_field(model_config(model_dir), "max_position_embeddings") or cap or 4096
    return min(own, cap) if cap > 0 else own


def checkpoint_dtype(model_dir: str) -> str | None:
    """The dtype the weights were saved in ("float32", "bfloat16", ...), if the config says."""
    cfg = model_config(model_dir)
    value = cfg.get("torch_dtype") or cfg.get("dtype")
    return str(value) if value else None


def eos_ids(*values: Any) -> tuple[int, ...]:
    """The EOS ids that `eos_token_id` values name (each an int, a list of ints or None), as one sorted tuple:
    a model's config.json and generation_config.json may each name some."""
    ids: set[int] = set()
    for eos in values:
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return tuple(sorted(ids))


def whole_safetensors(path: Path) -> bool:
    """Whether a safetensors file holds every byte its header names: a copy cut short (a full disk, a killed copy)
    does not, and would fail every worker's start."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n > size:
                return False
            header = json.loads(f.read(n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        return size == 8 + n + end
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return False
