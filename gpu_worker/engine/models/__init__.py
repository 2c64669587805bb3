"""The model architectures the runner can run, each in a module of its own."""

from gpu_worker.engine.models.llama import AttentionMetadata, Llama, PrefillChunk

__all__ = ["AttentionMetadata", "Llama", "PrefillChunk"]
