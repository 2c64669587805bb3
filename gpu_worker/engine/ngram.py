"""N-gram speculation (vLLM's prompt lookup): draft tokens taken from the sequence's own earlier text.

When the sequence's last n tokens (n from `max_n` down to `min_n`, the longest first) occurred before, the
tokens that followed their most recent earlier occurrence are the draft. The engine then computes the
draft's positions in the same step as the sequence's next token and keeps each draft token only where it is
the token the sampler draws at that position anyway (`LLMEngine._postprocess`): what a request produces is
token for token what it produces without speculation, greedy or seeded. Copying text (editing, summarising,
code, quoting a prompt) is where drafts are accepted.

Each sequence keeps an index of its n-grams (`NgramIndex`): a step adds only its new tokens, so a proposal
costs a dictionary lookup per n, not a scan of the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class NgramConfig:
    num_speculative_tokens: int = 4  # draft tokens at most per step
    prompt_lookup_min: int = 2  # shortest suffix matched
    prompt_lookup_max: int = 4  # longest suffix matched

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max")


@dataclass
class NgramIndex:
    """Where each n-gram of a sequence last ended: `ends[n][gram]` = j, the most recent j with
    tokens[j - n : j] == gram, over every j up to `upto` (the sequence's length when last proposed from,
    so its own suffix never matches itself)."""
    config: NgramConfig
    ends: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    upto: int = 0

    def propose(self, tokens: list[int], most: int) -> list[int]:
        """Up to `most` draft tokens to follow `tokens` (empty when no suffix occurred before)."""
        c, length = self.config, len(tokens)
        for n in range(c.prompt_lookup_min, c.prompt_lookup_max + 1):
            grams = self.ends.setdefault(n, {})
            for j in range(max(self.upto, n), length):  # the n-grams ending before the newest token
                grams[tuple(tokens[j - n : j])] = j
        self.upto = max(self.upto, length)
        if most < 1:
            return []
        for n in range(min(c.prompt_lookup_max, length), c.prompt_lookup_min - 1, -1):
            end = self.ends[n].get(tuple(tokens[length - n :]))
            if end is not None:
                return tokens[end : end + min(most, c.num_speculative_tokens)]
        return []
