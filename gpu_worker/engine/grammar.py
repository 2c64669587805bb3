"""Grammars in the engine: a matcher per constrained sequence (xgrammar), and one token bitmask per step
filled for the rows that have one and applied to their logits in place. Rows without a grammar pay nothing."""

from __future__ import annotations

import torch
import xgrammar as xgr


class GrammarState:
    """One sequence's place in its grammar."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)

    def accept(self, token: int) -> bool:
        return bool(self.matcher.accept_token(token))

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def replay(self, ids: list[int]) -> None:
        """Catch up with tokens already generated (a resumed job): each must be accepted."""
        for t in ids:
            if not self.accept(t):
                raise ValueError(f"the recorded token {t} does not fit the grammar")

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


_buffer: torch.Tensor | None = None  # the step's bitmask, grown when needed, reused


def mask_logits(logits: torch.Tensor, states: list[GrammarState | None]) -> None:
    """Bar, in place, every token a row's grammar does not allow next (float32 logits [rows, vocab])."""
    global _buffer
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return
    n, vocab = logits.shape
    words = (vocab + 31) // 32
    if _buffer is None or _buffer.shape[0] < n or _buffer.shape[1] != words:
        _buffer = xgr.allocate_token_bitmask(max(n, 8), vocab)
    bitmask = _buffer[:n]
    for i in rows:
        states[i].fill(bitmask, i)  # type: ignore[union-attr]
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
