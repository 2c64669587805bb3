"""Per-request sampling inside one batch: greedy, temperature, top-k, min-p, top-p, seeded.

A sampled token depends only on the row's logits, the request's seed and the token's index,
so a request reproduces whatever else shares its batch, and after preemption or resumption
on another worker.

Rows that shape their logits first (penalties, logit_bias, min_tokens, a grammar: `shape_logits`) do so
on a float32 copy of those rows only, each control one batched op over the rows that ask for it; rows
without one pay nothing. Logprobs are the model's own log-softmax, before any of that (vLLM's default).

All sampled rows go through one set of batched tensor ops (temperature, top-k, min-p, softmax, top-p,
inverse-CDF draw; min-p before top-p, as vLLM): the cost of a step's sampling barely grows with its rows. Each
row's draw is one uniform number made from (seed, token index) by integer arithmetic, not a torch generator, so
it is the same on every device and needs no per-row generator state.
"""

from __future__ import annotations

import math

import torch

from gpu_worker.engine.logprobs import Logprobs
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
    def __init__(self, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.eos_token_ids = list(eos_token_ids)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], ahead: list[int] | None = None,
                 ) -> tuple[list[int], dict[int, str], list[Logprobs | None]]:
        """A token per row, the rows that could not be sampled, with why (a row with NaN or inf logits,
        or one whose sampling raised, fails alone), and each row's logprobs (None where not asked).
        `ahead[i]`: row i draws the token that many places after its sequence's next (a draft's positions)."""
        raw = logits
        # every row's token: the greedy rows' here, the others' drawn below (0 holds the place of a row that fails);
        # no argmax of the rows that draw (~1.5 ms of a float32 step at 32 rows of 49,152)
        out = [0] * len(seqs)
        greedy = [i for i, s in enumerate(seqs) if s.greedy]
        if greedy:
            # logits come in the model's dtype: an argmax is the same in any float width, and upcasting a whole
            # bf16 batch to float32 costs more than its argmax (~1.3 ms inside a step at 32 rows of 49,152)
            top = logits if len(greedy) == len(seqs) else logits[greedy]
            for i, token in zip(greedy, top.max(dim=-1).indices.tolist()):  # first maximum, as argmax; ~2.5x faster
                out[i] = token
        # one reduction per row: any NaN or inf in a row makes its sum non-finite (float16 summed in
        # float32, where finite logits could overflow; bfloat16 has float32's range)
        wide = torch.float32 if logits.dtype == torch.float16 else None
        finite = torch.isfinite(logits.sum(dim=-1, dtype=wide)).tolist()
        errors = {i: "the model produced non-finite logits (NaN or inf)" for i, ok in enumerate(finite) if not ok}
        shaped = [i for i, s in enumerate(seqs) if s.req.shapes_logits and i not in errors]
        if shaped:  # penalties, bias, min_tokens, grammars: on a float32 copy of those rows only
            x = logits[shaped].to(torch.float32, copy=True)
            try:
                shape_logits(x, [seqs[i] for i in shaped], self.eos_token_ids)
            except (RuntimeError, ValueError) as exc:
                errors.update({i: f"applying the sampling controls failed: {exc}" for i in shaped})
            else:
                if len(shaped) == len(seqs):  # every row shaped (a batch of grammars): x is the batch
                    logits = x
                else:
                    logits = logits.to(torch.float32, copy=True)
                    logits[shaped] = x
                shaped_greedy = [j for j, i in enumerate(shaped) if seqs[i].greedy]  # the others draw below
                if shaped_greedy:
                    for j, token in zip(shaped_greedy, x[shaped_greedy].max(dim=-1).indices.tolist()):
                        out[shaped[j]] = token
        rows = [i for i, s in enumerate(seqs) if not s.greedy and i not in errors]
        if rows:
            try:
                tokens = self.sample(logits[rows] if len(rows) < len(seqs) else logits, [seqs[i] for i in rows],
                                     [ahead[i] for i in rows] if ahead else None)
            except (RuntimeError, ValueError):  # one row's trouble must not fail its neighbours: row by row
                tokens = []
                for i in rows:
                    try:
                        tokens += self.sample(logits[i : i + 1], [seqs[i]], [ahead[i]] if ahead else None)
                    except (RuntimeError, ValueError) as exc:
                        errors[i] = f"sampling failed: {exc}"
                        tokens.append(out[i])
            for i, token in zip(rows, tokens):
                if i not in errors:
                    out[i] = token
        return out, errors, logprobs_of(raw, seqs, out)

    @staticmethod
    def sample(logits: torch.Tensor, seqs: list[Sequence], ahead: list[int] | None = None) -> list[int]:
        """One token per row of `logits` ([rows, vocab]) for the matching sequence (`ahead` as in __call__)."""
        vocab = logits.shape[1]
        dev = logits.device
        temperatures = [s.req.temperature for s in seqs]
        x = logits.float()
        if any(t != 1.0 for t in temperatures):  # (x / 1 is x, bit for bit: the rows at 1, OpenAI's default, skip it)
            x = x / torch.tensor(temperatures, device=dev).unsqueeze(1)
        ks = [s.req.top_k if 0 < s.req.top_k < vocab else 0 for s in seqs]
        if any(ks):  # keep each row's k largest (ties with the k-th kept too); k = 0 keeps all
            top = torch.topk(x, max(ks), dim=-1).values
            kth = top.gather(1, torch.tensor([[max(k, 1) - 1] for k in ks], device=dev))
            kth.masked_fill_(torch.tensor([[k == 0] for k in ks], device=dev), float("-inf"))
            x = x.masked_fill(x < kth, float("-inf"))
        mins = [s.req.min_p for s in seqs]
        if any(mins):  # drop what is less likely than min_p times the row's most likely: x < max + log(min_p)
            floor = torch.tensor([[math.log(p) if p > 0 else float("-inf")] for p in mins], device=dev)
            x = x.masked_fill(x < x.max(dim=-1, keepdim=True).values + floor, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        u = torch.tensor([[token_uniform(s.req.seed, s.num_generated + (ahead[i] if ahead else 0))]
                          for i, s in enumerate(seqs)], dtype=torch.float64, device=dev)
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
    """Top-p: among the most likely tokens (equal probabilities in token order), the smallest prefix whose mass
    reaches top_p, then an inverse-CDF draw inside it. The candidates come from top-k over `_rank_keys`, widened
    until every row's cutoff falls inside them (a full sort of the vocabulary costs ~50x more): each widening to at
    least what the mass still missing needs at the k-th token's probability (no later token is likelier), at least
    8x, and past half the vocabulary to all of it. The keys order tokens totally, so the candidates and their order
    do not depend on k (nor on the rows beside, which widen k for all)."""
    vocab = probs.shape[1]
    keys = _rank_keys(probs)
    k = min(vocab, 512)
    while True:
        idx = torch.topk(keys, k, dim=-1).indices if k < vocab else keys.argsort(dim=-1, descending=True)
        vals = probs.gather(1, idx)
        cum = vals.cumsum(dim=-1, dtype=torch.float64)
        if k == vocab or bool((cum[:, -1:] >= top_p).all()):
            break
        missing = (top_p - cum[:, -1:]).clamp(min=0) / vals[:, -1:].double().clamp(min=1e-30)
        k = max(k * 8, k + int(missing.max().ceil().clamp(max=vocab).item()))
        k = vocab if k > vocab // 2 else k
    kept = vals.masked_fill(cum - vals >= top_p, 0.0).cumsum(dim=-1, dtype=torch.float64)
    return idx.gather(1, _pick(kept, u * kept[:, -1:]))


def _rank_keys(probs: torch.Tensor) -> torch.Tensor:
    """int64 per token of float32 probabilities [rows, vocab]: its probability's bits (ordered as the values are, for
    values >= 0), then its token id reversed: larger for a likelier token, and for the lower id of equal ones."""
    ids = torch.arange(probs.shape[1], device=probs.device)
    return (probs.contiguous().view(torch.int32).long() << 32) | (0xFFFF_FFFF - ids)


def padded(lists: list[list[int]], pad: int, device: torch.device, width: int | None = None,
           dtype: torch.dtype = torch.long) -> torch.Tensor:
    """The lists as one [len(lists), width] tensor: each cut or padded with `pad` to `width` items (None: the
    longest one's length, at least 1)."""
    if width is None:
        width = max(1, max(len(x) for x in lists))
    return torch.tensor([x[:width] + [pad] * (width - len(x[:width])) for x in lists], dtype=dtype, device=device)


def shape_logits(x: torch.Tensor, seqs: list[Sequence], eos_token_ids: list[int]) -> None:
    """Apply each row's controls in place on float32 logits [rows, vocab]: logit_bias, min_tokens (its stop
    tokens barred), then the penalties as vLLM and transformers define them (repetition over prompt and
    output tokens; frequency and presence over the output), and last the grammar's mask. One batched op per
    control, over the rows that ask for it."""
    rows, vocab = x.shape
    dev = x.device
    bias = [(j, t, v) for j, s in enumerate(seqs) for t, v in zip(s.req.bias_ids, s.req.bias_values) if t < vocab]
    if bias:
        r, t, v = zip(*bias)
        x.index_put_((torch.tensor(r, device=dev), torch.tensor(t, device=dev)),
                     torch.tensor(v, dtype=x.dtype, device=dev), accumulate=True)
    # (a grammar decides on its own when EOS may come: barring it too could leave a row no token at all)
    barred = [(j, t) for j, s in enumerate(seqs) if s.num_generated < s.req.min_tokens and s.grammar is None
              for t in {*s.req.stop_token_ids, *([] if s.req.ignore_eos else eos_token_ids)} if t < vocab]
    if barred:
        r, t = zip(*barred)
        x.index_put_((torch.tensor(r, device=dev), torch.tensor(t, device=dev)),
                     torch.tensor(float("-inf"), device=dev))
    rep = [j for j, s in enumerate(seqs) if s.req.repetition_penalty != 1.0]
    if rep:
        seen = torch.zeros(len(rep), vocab + 1, dtype=torch.bool, device=dev)
        seen.scatter_(1, padded([seqs[j].token_ids for j in rep], vocab, dev), True)
        seen = seen[:, :vocab]
        penalty = torch.tensor([[seqs[j].req.repetition_penalty] for j in rep], dtype=x.dtype, device=dev)
        sub = x[rep]
        x[rep] = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    counted = [j for j, s in enumerate(seqs) if s.req.frequency_penalty or s.req.presence_penalty]
    if counted:
        ids = padded([seqs[j].token_ids[seqs[j].num_prompt:] for j in counted], vocab, dev)
        counts = torch.zeros(len(counted), vocab + 1, dtype=x.dtype, device=dev)
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=x.dtype))
        counts = counts[:, :vocab]
        freq = torch.tensor([[seqs[j].req.frequency_penalty] for j in counted], dtype=x.dtype, device=dev)
        pres = torch.tensor([[seqs[j].req.presence_penalty] for j in counted], dtype=x.dtype, device=dev)
        x[counted] -= freq * counts + pres * (counts > 0)
    if any(s.grammar is not None for s in seqs):
        from gpu_worker.engine.grammar import mask_logits  # xgrammar loads only once a grammar arrives

        mask_logits(x, [s.grammar for s in seqs])


def logprobs_of(logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> list[Logprobs | None]:
    """The chosen tokens' logprobs and each row's top alternatives, for the rows that ask: the log-softmax
    of the model's own logits, in float32."""
    rows = [i for i, s in enumerate(seqs) if s.req.logprobs >= 0]
    out: list[Logprobs | None] = [None] * len(seqs)
    if not rows:
        return out
    for i, lp in zip(rows, token_logprobs(logits[rows], [tokens[i] for i in rows],
                                          [seqs[i].req.logprobs for i in rows])):
        out[i] = lp
    return out


def token_logprobs(logits: torch.Tensor, targets: list[int], ks: list[int]) -> list[Logprobs]:
    """Per row of `logits` [rows, vocab]: the logprob of its target token and its ks[row] most likely
    alternatives, each as a one-token Logprobs."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    dev = lp.device
    chosen = lp.gather(1, torch.tensor(targets, dtype=torch.long, device=dev)[:, None]).squeeze(1).tolist()
    k = max(ks)
    if not k:
        return [Logprobs([c], [[]], [[]]) for c in chosen]
    # one topk for the step, at its largest count; which tokens of a tie it returns, and in what order, follows
    # that count, so each row's list is put in a total order of its own: logprob, then token id
    vals, idx = torch.topk(lp, k, dim=-1)
    cut = vals.gather(1, torch.tensor([[max(n, 1) - 1] for n in ks], device=dev))  # each row's n-th value
    at_cut = (lp == cut).sum(dim=1).tolist()
    top_v, top_i, cut_v = vals.tolist(), idx.tolist(), cut.squeeze(1).tolist()
    out = []
    for r, (c, n) in enumerate(zip(chosen, ks)):
        pairs = sorted(zip(top_v[r][:n], top_i[r][:n]), key=lambda p: (-p[0], p[1]))
        tied = [p for p in pairs if p[0] == cut_v[r]]
        if n and len(tied) < at_cut[r]:  # a tie across the row's cut: its lowest ids, wherever topk stopped
            ids = torch.nonzero(lp[r] == cut_v[r]).squeeze(1)[: len(tied)].tolist()
            pairs = [p for p in pairs if p[0] != cut_v[r]] + [(cut_v[r], i) for i in ids]
        out.append(Logprobs([c], [[i for _, i in pairs]], [[v for v, _ in pairs]]))
    return out
