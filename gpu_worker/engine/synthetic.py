"""A zero-cost synthetic engine: a benchmark instrument for the plumbing, never the default.

It implements the `Engine` protocol (engine/protocol.py) and emits one fixed token per running
request per step, with no model, so the cost of everything around the engine (streams, lanes,
relay) can be measured.
Selected with ENGINE=synthetic. Like the rest of the worker's lanes, it imports no torch.
"""

from __future__ import annotations

from gpu_worker.engine.step import StepOutput
from shared.jobs import FinishReason
from shared.schemas import Request

WORD_TOKEN = 2030  # " further" in the SmolLM2 vocabulary; any ordinary token works


class SyntheticEngine:
    max_model_len: int = 1 << 20
    batch_invariant = True  # one fixed token whatever runs beside it

    def __init__(self, max_num_seqs: int = 256) -> None:
        self.max_num_seqs = max_num_seqs
        self.remaining: dict[str, int] = {}
        self.waiting: list[str] = []
        self._pending: list[StepOutput] = []

    def add_request(self, req: Request) -> None:
        self.remaining[req.id] = max(0, req.max_tokens - len(req.resume_ids))
        self.waiting.append(req.id)

    def abort_request(self, req_id: str, reason: FinishReason = FinishReason.cancelled) -> bool:
        if self.remaining.pop(req_id, None) is None:
            return False
        if req_id in self.waiting:
            self.waiting.remove(req_id)
        self._pending.append(StepOutput(req_id, finish_reason=FinishReason(reason)))
        return True

    def has_unfinished(self) -> bool:
        return bool(self.remaining or self._pending)

    @property
    def num_running(self) -> int:
        return len(self.remaining) - len(self.waiting)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def kv_usage(self) -> float:
        return 0.0

    def preemptions(self) -> tuple[int, int, int]:
        return 0, 0, 0

    def speculation(self) -> tuple[int, int]:
        return 0, 0

    def lora_counts(self) -> tuple[int, int, int]:
        return 0, 0, 0

    def step(self) -> list[StepOutput]:
        outs, self._pending = self._pending, []
        while self.waiting and self.num_running < self.max_num_seqs:
            self.waiting.pop(0)
        running = [r for r in self.remaining if r not in self.waiting]
        for rid in running:
            left = self.remaining[rid] - 1
            done = left <= 0
            outs.append(StepOutput(rid, [WORD_TOKEN], FinishReason.length if done else None))
            if done:
                del self.remaining[rid]
            else:
                self.remaining[rid] = left
        return outs
