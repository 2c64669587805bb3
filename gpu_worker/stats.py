"""The worker's counters, written into its heartbeat (the autoscaler and `conveyor status` read them)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(slots=True)
class WorkerStats:
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    steps: int = 0
    generated_tokens: int = 0
    jobs_started: int = 0
    jobs_resumed: int = 0
    # sequences preempted since the worker started: all of them, and of those for fair share or for priority
    preemptions: int = 0
    fair_preemptions: int = 0
    priority_preemptions: int = 0
    # speculative decoding since the worker started: draft tokens computed, and of those kept
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # LoRA adapters resident now, and loaded and evicted since the worker started
    lora_resident: int = 0
    lora_loads: int = 0
    lora_evictions: int = 0
    # whether its engine keeps a request's tokens whatever shares its steps (the seed promise; Engine.batch_invariant)
    batch_invariant: bool = True

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
