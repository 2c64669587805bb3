"""A continuous-batching engine that knows nothing of Redis: add requests, abort them, step.

Importing this package does not import torch: `LLMEngine` is loaded on first use, so the
synthetic engine and the worker's lanes stay light.
"""

from gpu_worker.engine.protocol import Engine, EngineConfig
from gpu_worker.engine.sequence import Request
from gpu_worker.engine.step import StepBatch, StepOutput

__all__ = ["Engine", "EngineConfig", "LLMEngine", "Request", "StepBatch", "StepOutput"]


def __getattr__(name: str):
    if name == "LLMEngine":
        from gpu_worker.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
