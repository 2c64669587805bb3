"""Logprobs as the engine reports them, per token: plain data (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprobs:
    """Logprobs of a run of tokens: per token, the chosen token's and its top alternatives' (ids and
    logprobs, most likely first; none when the request asked for 0)."""
    chosen: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_lps: list[list[float]] = field(default_factory=list)

    def extend(self, other: Logprobs) -> None:
        self.chosen += other.chosen
        self.top_ids += other.top_ids
        self.top_lps += other.top_lps

    def __len__(self) -> int:
        return len(self.chosen)
