"""Where the engine runs and in which dtype: `auto` resolved per device and checkpoint, as vLLM does."""

from __future__ import annotations

import torch

from gpu_worker.engine.host_memory import keep_freed_memory

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """`auto`: CUDA where available, else CPU. On CPU, malloc is first told to keep what steps free
    (host_memory.py)."""
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)
    if device.type == "cpu":
        keep_freed_memory()
    return device


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
