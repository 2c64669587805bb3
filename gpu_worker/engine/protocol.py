"""The interface the inference worker drives. Both the torch engine (`LLMEngine`) and the
zero-cost synthetic engine implement it; the worker imports neither directly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from gpu_worker.engine.ngram import NgramConfig
from gpu_worker.engine.step import StepOutput
from shared.jobs import FinishReason
from shared.schemas import Request


@dataclass
class EngineConfig:
    model: str
    device: str = "auto"
    dtype: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 0  # 0: per device (DEFAULT_BATCHED_TOKENS)
    # while sequences decode, new prompts start together on every Nth step at most (scheduler.py); 1 for an engine
    # driven directly (each step computes what is asked), the service's default is ADMIT_EVERY_STEPS (4)
    admit_every: int = 1
    kv_cache_mb: int = 2048
    max_model_len: int = 4096  # the context served, at most the model's own; 0: the model's own
    threads: int = 0
    block_size: int = 16  # tokens per KV-cache block
    prefix_caching: bool = True
    checkpoint_dtype: str | None = None  # the weights' saved dtype, for dtype=auto ("bfloat16", ...); None: unknown
    speculative: NgramConfig | None = None  # n-gram speculative decoding (ngram.py); None: off
    cpu_kernels: bool = True  # on CPU, the compiled kernels where they build (cpu_kernels.py)
    cpu_gemm: str = "packed"  # with cpu_kernels: "packed" (gemm.PackedGemm where the CPU has it) or "onednn"
    max_loras: int = 4  # LoRA adapters resident at once (lora.py), so at most this many in a step
    max_lora_rank: int = 16  # each resident adapter's slot is this wide (lora.py)


class Engine(Protocol):
    @property
    def max_model_len(self) -> int:
        """The context served, in tokens."""

    @property
    def batch_invariant(self) -> bool:
        """Whether a request's tokens are those it gets alone, whatever shares its steps (the seed promise)."""

    def add_request(self, req: Request) -> None:
        """Queue a request; a request that cannot run ends in the next step's outputs."""

    def abort_request(self, req_id: str, reason: FinishReason = FinishReason.cancelled) -> bool:
        """End a request; its end appears in the next step's outputs. False if unknown."""

    def has_unfinished(self) -> bool: ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    def kv_usage(self) -> float:
        """Fraction of the KV-cache budget in use, 0..1."""

    def preemptions(self) -> tuple[int, int, int]:
        """Sequences preempted so far: all, and of those for fair share and for priority."""

    def speculation(self) -> tuple[int, int]:
        """Speculative draft tokens computed so far, and of those kept (SPECULATIVE=ngram)."""

    def lora_counts(self) -> tuple[int, int, int]:
        """LoRA adapters resident now, and loaded and evicted so far."""

    def step(self) -> list[StepOutput]:
        """Run one step; return every request's new tokens and ends."""
