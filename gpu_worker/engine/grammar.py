"""Grammars in the engine: a matcher per constrained sequence (xgrammar's GrammarMatcher), and per step one
token bitmask, filled for the rows that have a grammar and applied to their logits in place. Rows without one
pay nothing; a step with none does not come here.

How a constrained sequence ends: once the grammar is complete and nothing may follow, the bitmask allows only
the stop tokens (the model's EOS ids, or those given); the sampled stop token is accepted and the matcher is
terminated. When the grammar may still go on (`[a-z]+`), the stop token is one choice among others. A sequence
whose matcher is terminated is finished ("stop"), ignore_eos or not: nothing may follow.

Cost, measured on a 2-core CPU at vocabulary 49,152: filling a row's bitmask ~1-3 us (xgrammar precomputed
most of it at compile time, and fills several rows on its own threads); applying it ~35 us a row (a byte
lookup added to the logits, `_apply_on_cpu`; on CUDA, xgrammar's Triton kernel).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Mapping

import torch
import xgrammar as xgr


class GrammarState:
    """One sequence's place in its grammar. Not thread-safe: the engine loop alone uses it."""

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: Iterable[int] | None = None) -> None:
        stop = sorted(set(stop_token_ids)) if stop_token_ids is not None else None
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop or None)
        self.vocab_size = compiled.tokenizer_info.vocab_size  # the bitmask's width, in tokens
        self.stop_token_ids: list[int] = list(self.matcher.stop_token_ids)

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False (and no change) when the grammar does not allow it."""
        return bool(self.matcher.accept_token(token_id))

    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: the sequence ends here."""
        return bool(self.matcher.is_terminated())

    def is_completed(self) -> bool:
        """What was accepted so far is a whole match (a stop token may come next)."""
        return bool(self.matcher.is_completed())

    def replay(self, ids: Iterable[int]) -> None:
        """Start over and catch up with tokens already generated (a resumed job); ValueError when one of them
        does not fit the grammar (then the state is where that token was refused)."""
        self.matcher.reset()
        for i, token in enumerate(ids):
            if not self.accept(token):
                raise ValueError(f"the recorded token {token} (output token {i}) does not fit the grammar")

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into bitmask[row] (int32 CPU, a bit per token); once terminated, only
        the stop tokens."""
        if self.matcher.is_terminated():  # xgrammar refuses to fill then; the engine should have ended it
            bitmask[row].zero_()
            for t in self.stop_token_ids:
                bitmask[row, t // 32] |= _bit(t % 32)
            return
        self.matcher.fill_next_token_bitmask(bitmask, row)


def _bit(i: int) -> int:
    """Bit i of an int32 word, as a signed value (bit 31 is the sign)."""
    return (1 << i) - (1 << 32 if i == 31 else 0)


class _Bitmask:
    """The step's bitmask, allocated once and grown when a step has more rows (int32 CPU, where xgrammar fills
    it), and its copy on the logits' device."""

    def __init__(self) -> None:
        self.host: torch.Tensor | None = None
        self.device: dict[torch.device, torch.Tensor] = {}
        self.batch: xgr.BatchGrammarMatcher | None = None  # fills many rows on xgrammar's threads

    def rows(self, n: int, vocab: int) -> torch.Tensor:
        words = (vocab + 31) // 32
        if self.host is None or self.host.shape[0] < n or self.host.shape[1] != words:
            rows = max(n, 2 * self.host.shape[0] if self.host is not None else 8)
            with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode
                self.host = xgr.allocate_token_bitmask(rows, vocab)
            if torch.cuda.is_available():
                self.host = self.host.pin_memory()
            self.device.clear()
        return self.host[:n]

    def on(self, mask: torch.Tensor, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            return mask
        buf = self.device.get(device)
        if buf is None or buf.shape[0] < mask.shape[0] or buf.shape[1] != mask.shape[1]:
            assert self.host is not None
            with torch.inference_mode(False):
                buf = self.device[device] = torch.empty_like(self.host, device=device)
        out = buf[: mask.shape[0]]
        out.copy_(mask, non_blocking=True)
        return out

    def fill(self, states: Mapping[int, GrammarState], rows: list[int], mask: torch.Tensor) -> None:
        """Fill mask[r] for each row r from states[r]: several at once on xgrammar's threads."""
        live = [r for r in rows if not states[r].matcher.is_terminated()]
        rest = rows
        if len(live) > 1:
            if self.batch is None:
                self.batch = xgr.BatchGrammarMatcher()
            self.batch.batch_fill_next_token_bitmask([states[r].matcher for r in live], mask, live)
            rest = [r for r in rows if states[r].matcher.is_terminated()]
        for r in rest:
            states[r].fill(mask, r)


_BITMASK = _Bitmask()


def mask_logits(logits: torch.Tensor, states: list[GrammarState | None]) -> None:
    """Bar, in place (-inf), every token each row's grammar does not allow next, for the rows with a state
    (logits [rows, width], float32, bfloat16 or float16, on any device). Tokens past the grammar's vocabulary
    (a model whose logits are wider than its tokenizer) are barred too."""
    held = {i: s for i, s in enumerate(states) if s is not None}
    rows = list(held)
    if not rows:
        return
    n, width = logits.shape
    vocab = held[rows[0]].vocab_size
    mask = _BITMASK.rows(n, vocab)
    _BITMASK.fill(held, rows, mask)
    cols = min(vocab, width)
    if logits.device.type == "cpu":
        _apply_on_cpu(logits, mask, rows, cols)
    else:
        triton = logits.device.type == "cuda" and _TRITON
        xgr.apply_token_bitmask_inplace(logits, _BITMASK.on(mask, logits.device), vocab_size=cols, indices=rows,
                                        backend="triton" if triton else "torch_native")
    if width > vocab:
        logits[rows, vocab:] = float("-inf")


# what adding a mask byte does to its 8 tokens' logits: 0 where its bit is set (allowed), -inf where not
_BYTE = torch.tensor([[0.0 if b >> j & 1 else float("-inf") for j in range(8)] for b in range(256)])
_TRITON = importlib.util.find_spec("triton") is not None  # xgrammar's CUDA kernel is a Triton one


def _apply_on_cpu(logits: torch.Tensor, mask: torch.Tensor, rows: list[int], cols: int) -> None:
    """Set logits[r, j] to -inf where bit j of mask[r] is 0, for r in rows and j < cols: each mask byte
    looked up as its 8 tokens' 0 or -inf, added in place (allowed logits stay exact: x + 0.0 == x). ~1.1 ms
    for 32 rows of 49,152 here, against 4.4 ms unpacking the bits by masked ops and ~190 us a row in
    xgrammar's CPU kernel."""
    # every row: one op over the batch in place; some: those rows alone, the others untouched
    idx: slice | torch.Tensor = slice(None) if len(rows) == logits.shape[0] else torch.tensor(rows)
    add = _BYTE.index_select(0, mask[idx].view(torch.uint8).reshape(-1).int()).view(len(rows), mask.shape[1] * 32)
    logits[idx, :cols] += add[:, :cols].to(logits.dtype)
