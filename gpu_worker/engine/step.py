"""What one engine step computes and what it yields. Plain data: no torch, so the scheduler, the
synthetic engine and the worker's lanes can use these without importing the model's stack."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpu_worker.engine.logprobs import Logprobs
from gpu_worker.engine.sequence import Sequence
from shared.jobs import FinishReason


@dataclass
class StepBatch:
    """The scheduler's answer for one step."""
    decode: list[Sequence]  # each computes its last token, and its draft's when it has one (speculation)
    chunks: list[tuple[Sequence, int]]  # (sequence, tokens to compute), more than one each

    @property
    def num_tokens(self) -> int:
        return sum(1 + len(s.draft) for s in self.decode) + sum(n for _, n in self.chunks)


@dataclass
class Sampled:
    """What a step sampled: a token for each sequence that reached its end, in order, the rows
    that could not be sampled (their index in `seqs`), with why, and each row's logprobs (None for
    rows that did not ask)."""
    seqs: list[Sequence] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)
    logprobs: list[Logprobs | None] = field(default_factory=list)

    def extend(self, other: Sampled) -> None:
        self.errors.update({len(self.seqs) + i: why for i, why in other.errors.items()})
        self.seqs += other.seqs
        self.tokens += other.tokens
        self.logprobs += other.logprobs


@dataclass
class StepOutput:
    """One request's result of a step: the tokens it produced, and its end if it ended."""
    id: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    logprobs: Logprobs | None = None  # of token_ids, when the request asked
    prompt_ids: list[int] | None = None  # the prompt and its tokens' logprobs (from the second token on),
    prompt_logprobs: Logprobs | None = None  # once, when the request asked (echo)
    timeline: list[tuple[str, float, int]] | None = None  # a traced job's engine events since its last output
    scheduled_at: float = 0.0  # with its first output: when it was first scheduled (unix s)
