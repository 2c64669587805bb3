"""A continuous-batching engine that knows nothing of Redis: add requests, abort them, step.

Importing this package does not import torch: `LLMEngine` is loaded on first use, so the
synthetic engine and the worker's lanes stay light.

The request it takes is `shared.schemas.Request`, imported from there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpu_worker.engine.protocol import Engine, EngineConfig
from gpu_worker.engine.step import StepBatch, StepOutput

if TYPE_CHECKING:
    from gpu_worker.engine.llm_engine import LLMEngine

__all__ = ["Engine", "EngineConfig", "LLMEngine", "StepBatch", "StepOutput"]


def __getattr__(name: str) -> type[LLMEngine]:
    if name == "LLMEngine":
        from gpu_worker.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
