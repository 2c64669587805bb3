"""A request as the engine sees it: token ids in, token ids out, and the KV-cache blocks it holds."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from shared.limits import TEMPERATURE_FLOOR


@dataclass
class Request:
    id: str
    prompt_ids: list[int]
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # tokens already generated elsewhere (a resumed job): prefilled after the prompt, not re-emitted
    resume_ids: list[int] = field(default_factory=list)


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, req: Request) -> None:
        self.req = req
        self.id = req.id
        self.token_ids: list[int] = list(req.prompt_ids) + list(req.resume_ids)
        self.num_prompt = len(req.prompt_ids)
        self.num_computed = 0  # tokens whose K/V are in the cache
        self.block_table: list[int] = []  # KV-cache blocks, in token order (see block_manager.py)
        self.num_hashed_blocks = 0  # leading blocks registered in (or served by) the prefix cache
        self.last_block_hash = 0
        self.status = SeqStatus.WAITING
        self.arrival = time.monotonic()
        self.finish_reason: str | None = None
        self.num_preemptions = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def greedy(self) -> bool:
        return self.req.temperature < TEMPERATURE_FLOOR

    def __repr__(self) -> str:
        return (f"Sequence({self.id!r}, tokens={self.num_tokens}, computed={self.num_computed}, "
                f"blocks={len(self.block_table)})")
