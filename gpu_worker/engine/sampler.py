"""Per-request sampling inside one batch: greedy, temperature, top-k, top-p, seeded.

A sampled token depends only on the row's logits, the request's seed and the token's index,
so a request reproduces whatever else shares its batch, and after preemption or resumption
on another worker.
"""

from __future__ import annotations

import torch

from gpu_worker.engine.sequence import Sequence

_MIX = 0x9E3779B97F4A7C15


def token_seed(seed: int, index: int) -> int:
    return ((seed * 6364136223846793005 + index * _MIX) ^ (seed >> 7)) & 0x7FFF_FFFF_FFFF_FFFF


class Sampler:
    def __init__(self) -> None:
        self._gen = torch.Generator()

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], dict[int, str]]:
        """A token per row, and the rows that could not be sampled, with why: a row with NaN or
        inf logits, or one whose sampling raised, fails alone."""
        out = logits.max(dim=-1).indices.tolist()  # first maximum, as argmax; ~2.5x faster on CPU
        # one reduction per row: any NaN or inf in a row makes its sum non-finite
        finite = torch.isfinite(logits.sum(dim=-1)).tolist()
        errors = {i: "the model produced non-finite logits (NaN or inf)" for i, ok in enumerate(finite) if not ok}
        for i, s in enumerate(seqs):
            if not s.greedy and i not in errors:
                try:
                    out[i] = self._sample(logits[i].cpu(), s)
                except (RuntimeError, ValueError) as exc:
                    errors[i] = f"sampling failed: {exc}"
        return out, errors

    def _sample(self, row: torch.Tensor, s: Sequence) -> int:
        r = s.req
        row = row / r.temperature
        if 0 < r.top_k < row.numel():
            kth = torch.topk(row, r.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if r.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_p, dim=-1)
            drop = cum - sorted_p > r.top_p  # keep the smallest prefix whose mass reaches top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        self._gen.manual_seed(token_seed(r.seed, s.num_generated))
        return int(torch.multinomial(probs, 1, generator=self._gen).item())
