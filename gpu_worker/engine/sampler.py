"""Per-request sampling inside one batch: greedy, temperature, top-k, top-p, seeded.

A sampled token depends only on the row's logits, the request's seed and the token's index,
so a request reproduces whatever else shares its batch, and after preemption or resumption
on another worker.

All sampled rows go through one set of batched tensor ops (temperature, top-k, softmax, top-p,
inverse-CDF draw): the cost of a step's sampling barely grows with its rows. Each row's draw is
one uniform number made from (seed, token index) by integer arithmetic, not a torch generator, so
it is the same on every device and needs no per-row generator state.
"""

from __future__ import annotations

import torch

from gpu_worker.engine.sequence import Sequence

_MIX = 0x9E3779B97F4A7C15
_U53 = float(1 << 53)


def token_seed(seed: int, index: int) -> int:
    return ((seed * 6364136223846793005 + index * _MIX) ^ (seed >> 7)) & 0x7FFF_FFFF_FFFF_FFFF


def token_uniform(seed: int, index: int) -> float:
    """A uniform number in [0, 1) for the index-th generated token of a request with this seed."""
    x = token_seed(seed, index)
    x ^= x >> 31  # splitmix64's finaliser: every input bit reaches the top 53 bits
    x = (x * 0xBF58476D1CE4E5B9) & 0xFFFF_FFFF_FFFF_FFFF
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & 0xFFFF_FFFF_FFFF_FFFF
    x ^= x >> 31
    return (x >> 11) / _U53


class Sampler:
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], dict[int, str]]:
        """A token per row, and the rows that could not be sampled, with why: a row with NaN or
        inf logits, or one whose sampling raised, fails alone."""
        # logits come in the model's dtype: an argmax is the same in any float width, and upcasting a whole
        # bf16 batch to float32 costs more than its argmax (~1.3 ms inside a step at 32 rows of 49,152)
        out = logits.max(dim=-1).indices.tolist()  # first maximum, as argmax; ~2.5x faster on CPU
        # one reduction per row: any NaN or inf in a row makes its sum non-finite (float16 summed in
        # float32, where finite logits could overflow; bfloat16 has float32's range)
        wide = torch.float32 if logits.dtype == torch.float16 else None
        finite = torch.isfinite(logits.sum(dim=-1, dtype=wide)).tolist()
        errors = {i: "the model produced non-finite logits (NaN or inf)" for i, ok in enumerate(finite) if not ok}
        rows = [i for i, s in enumerate(seqs) if not s.greedy and i not in errors]
        if not rows:
            return out, errors
        try:
            tokens = self.sample(logits[rows] if len(rows) < len(seqs) else logits, [seqs[i] for i in rows])
        except (RuntimeError, ValueError):  # one row's trouble must not fail its neighbours: row by row
            tokens = []
            for i in rows:
                try:
                    tokens += self.sample(logits[i : i + 1], [seqs[i]])
                except (RuntimeError, ValueError) as exc:
                    errors[i] = f"sampling failed: {exc}"
                    tokens.append(out[i])
        for i, token in zip(rows, tokens):
            if i not in errors:
                out[i] = token
        return out, errors

    @staticmethod
    def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """One token per row of `logits` ([rows, vocab]) for the matching sequence."""
        vocab = logits.shape[1]
        dev = logits.device
        x = logits.float() / torch.tensor([s.req.temperature for s in seqs], device=dev).unsqueeze(1)
        ks = [s.req.top_k if 0 < s.req.top_k < vocab else 0 for s in seqs]
        if any(ks):  # keep each row's k largest (ties with the k-th kept too); k = 0 keeps all
            top = torch.topk(x, max(ks), dim=-1).values
            kth = top.gather(1, torch.tensor([[max(k, 1) - 1] for k in ks], device=dev))
            kth.masked_fill_(torch.tensor([[k == 0] for k in ks], device=dev), float("-inf"))
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        u = torch.tensor([[token_uniform(s.req.seed, s.num_generated)] for s in seqs], dtype=torch.float64,
                         device=dev)
        nucleus = [i for i, s in enumerate(seqs) if s.req.top_p < 1.0]
        if not nucleus:
            return _draw(probs, u).squeeze(1).tolist()
        out = torch.empty(len(seqs), 1, dtype=torch.long, device=dev)
        rest = [i for i in range(len(seqs)) if seqs[i].req.top_p >= 1.0]
        if rest:
            out[rest] = _draw(probs[rest], u[rest])
        top_p = torch.tensor([[seqs[i].req.top_p] for i in nucleus], dtype=torch.float64, device=dev)
        out[nucleus] = _draw_nucleus(probs[nucleus], top_p, u[nucleus])
        return out.squeeze(1).tolist()


_BLOCK = 256  # the two-level draw: which block of the vocabulary, then which token in it
_BELOW = 1.0 - 2.0**-40  # keeps a draw inside the mass actually summed, whatever the summation order


def _pick(cdf: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative mass exceeds r (r in [0, total)): never a token of
    zero probability."""
    return torch.searchsorted(cdf, torch.minimum(r, cdf[:, -1:] * _BELOW), right=True)


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw of one token per row, [rows, 1]: block sums in one parallel reduction, a
    cumulative sum over the blocks, then over the chosen block's tokens only (a cumulative sum over
    the whole vocabulary is a sequential scan, ~10x the cost)."""
    rows, vocab = probs.shape
    pad = (-vocab) % _BLOCK
    blocks = (torch.nn.functional.pad(probs, (0, pad)) if pad else probs).view(rows, -1, _BLOCK)
    csum = blocks.sum(dim=-1).cumsum(dim=-1, dtype=torch.float64)
    target = u * csum[:, -1:]
    b = _pick(csum, target)
    before = torch.where(b > 0, csum.gather(1, (b - 1).clamp_(min=0)), torch.zeros_like(target))
    inner = blocks.gather(1, b.unsqueeze(-1).expand(rows, 1, _BLOCK)).squeeze(1).cumsum(dim=-1, dtype=torch.float64)
    return b * _BLOCK + _pick(inner, target - before)


def _draw_nucleus(probs: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Top-p: among the most likely tokens, the smallest prefix whose mass reaches top_p, then an
    inverse-CDF draw inside it. The candidates come from top-k, widened until every row's cutoff
    falls inside them (a full sort of the vocabulary costs ~50x more)."""
    vocab = probs.shape[1]
    k = min(vocab, 512)
    while True:
        vals, idx = torch.topk(probs, k, dim=-1)  # sorted, most likely first
        cum = vals.cumsum(dim=-1, dtype=torch.float64)
        if k == vocab or bool((cum[:, -1:] > top_p).all()):
            break
        k = min(vocab, k * 8)
    kept = vals.masked_fill(cum - vals > top_p, 0.0).cumsum(dim=-1, dtype=torch.float64)
    return idx.gather(1, _pick(kept, u * kept[:, -1:]))
