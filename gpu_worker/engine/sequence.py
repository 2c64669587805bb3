"""A request inside the engine: its token ids so far, its status, and the KV-cache blocks it holds."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Any

from gpu_worker.engine.logprobs import Logprobs

if TYPE_CHECKING:
    from shared.schemas import Request


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
        # the prompt's logprobs as its chunks are computed (echo), from its second token on; not again for
        # a resumed job (its first worker reported them)
        self.prompt_lp: Logprobs | None = Logprobs() if req.prompt_logprobs >= 0 and not req.resume_ids else None
        self.grammar: Any = None  # its grammar's matcher (gpu_worker/engine/grammar.py), when it has one
        self.ngrams: Any = None  # its n-gram index (gpu_worker/engine/ngram.py), when the engine speculates for it
        self.draft: list[int] = []  # this step's draft tokens, computed after its next token (speculation)
        # a traced job's engine events since its last output, (name, unix s, tokens): its prefill chunks and
        # preemptions, for the output lane's spans (gpu_worker/job_trace.py); None when the job is not traced
        self.timeline: list[tuple[str, float, int]] | None = [] if req.trace else None
        self.scheduled_at = 0.0  # when it was first scheduled (unix s): reported with its first output
        self.arrival = 0  # its place in the order of arrival at its scheduler (`Scheduler.add`), kept when preempted
        self.lora: Any = None  # its LoRA adapter (gpu_worker/engine/lora.py), resident while it lives; None: the base

    @property
    def hash_seed(self) -> int:
        """Where its prefix-cache hash chain starts (block_manager.py): K/V computed under an adapter serve only it."""
        return self.lora.salt if self.lora is not None else 0

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
    def decoding(self) -> bool:
        """Whether its next step is a decode row: one token left to compute, a generated one. A prompt's last
        token is prefilled, never decoded (a 1-token chunk where the prefix cache or a chunk boundary left it
        alone): the prefill kernel computes every prompt position, so its K/V and the first token's logits are the
        same bits however its chunks fell (the seed's promise, with speculation or a cached prefix)."""
        return self.num_uncomputed == 1 and self.num_tokens > self.num_prompt

    @property
    def greedy(self) -> bool:
        return self.req.greedy

    def __repr__(self) -> str:
        return (f"Sequence({self.id!r}, tokens={self.num_tokens}, computed={self.num_computed}, "
                f"blocks={len(self.block_table)})")
