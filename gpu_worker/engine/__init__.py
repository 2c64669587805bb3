"""A continuous-batching engine that knows nothing of Redis: add requests, abort them, step."""

from gpu_worker.engine.llm_engine import EngineConfig, LLMEngine, StepOutput
from gpu_worker.engine.sequence import Request

__all__ = ["EngineConfig", "LLMEngine", "Request", "StepOutput"]
