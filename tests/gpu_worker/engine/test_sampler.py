"""The batched sampler draws from the distribution a request asked for: temperature, top-k, top-p,
whatever else shares its batch, and reproducibly from (seed, token index)."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_worker.engine.sampler import Sampler, token_uniform
from gpu_worker.engine.sequence import Sequence
from shared.schemas import GenerationRequest, Request

DRAWS = 4000


def _seqs(n: int, **kw) -> list[Sequence]:
    return [Sequence(Request(f"r{i}", [1], seed=i, **kw)) for i in range(n)]


def _freq(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double() / len(tokens)


def test_draws_follow_softmax_of_logits_over_temperature() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    for temp in (1.0, 0.5, 2.0):
        tokens, errors, _ = Sampler()(logits.repeat(DRAWS, 1), _seqs(DRAWS, temperature=temp))
        assert not errors
        expected = torch.softmax(logits.double() / temp, dim=0)
        assert (_freq(tokens, 6) - expected).abs().max() < 0.03, (temp, _freq(tokens, 6), expected)


def test_top_k_keeps_only_the_k_most_likely_in_proportion() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0, 2.5, -1.0])
    tokens, _, _ = Sampler()(logits.repeat(DRAWS, 1), _seqs(DRAWS, top_k=3))
    f = _freq(tokens, 6)
    assert set(torch.nonzero(f).flatten().tolist()) == {1, 3, 4}
    expected = torch.softmax(torch.tensor([3.0, 2.0, 2.5], dtype=torch.float64), dim=0)
    assert (f[[1, 3, 4]] - expected).abs().max() < 0.03


def test_min_p_drops_what_is_less_likely_than_min_p_times_the_most_likely() -> None:
    """vLLM's min_p: tokens under min_p x the top token's probability are out, the rest drawn in proportion; applied
    before top_p (vLLM's order), so top_p's mass is counted over what min_p kept."""
    probs = torch.tensor([0.05, 0.4, 0.15, 0.3, 0.1])
    tokens, _, _ = Sampler()(probs.log().repeat(DRAWS, 1), _seqs(DRAWS, min_p=0.3))
    f = _freq(tokens, 5)  # 0.3 x 0.4 = 0.12: tokens 1, 2 and 3 stay
    assert f[0] == 0 and f[4] == 0
    assert (f[[1, 2, 3]] - torch.tensor([0.4, 0.15, 0.3], dtype=torch.float64) / 0.85).abs().max() < 0.03
    tokens, _, _ = Sampler()(probs.log().repeat(DRAWS, 1), _seqs(DRAWS, min_p=0.3, top_p=0.8))
    assert set(tokens) == {1, 3}  # of 0.4, 0.3, 0.15 (renormalised: 0.47, 0.35, 0.18) 0.8 takes the first two
    tokens, _, _ = Sampler()(probs.log().repeat(400, 1), _seqs(400, min_p=1.0))
    assert set(tokens) == {1}  # only the most likely


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    probs = torch.tensor([0.1, 0.5, 0.1, 0.3])
    tokens, _, _ = Sampler()(probs.log().repeat(DRAWS, 1), _seqs(DRAWS, top_p=0.7))
    f = _freq(tokens, 4)  # 0.5 + 0.3 reaches 0.7: tokens 1 and 3, renormalised
    assert f[0] == 0 and f[2] == 0
    assert abs(f[1] - 0.625) < 0.03 and abs(f[3] - 0.375) < 0.03


def test_top_p_stops_at_the_token_whose_mass_reaches_p_exactly() -> None:
    """Four tokens of 0.25 with top_p 0.5: the first two reach it, so the third is out (vLLM's and transformers'
    nucleus), however many draws."""
    tokens, _, _ = Sampler()(torch.zeros(4).repeat(DRAWS, 1), _seqs(DRAWS, top_p=0.5))
    assert set(tokens) == {0, 1}


def test_top_p_over_a_flat_vocabulary_reaches_past_its_first_candidates() -> None:
    vocab = 3000  # nearly flat: the nucleus holds most of the vocabulary, far more than 512 candidates
    logits = torch.zeros(vocab)
    logits[-500:] = -30.0  # these 500 together hold ~0 mass: never in a 0.95 nucleus
    tokens, _, _ = Sampler()(logits.repeat(DRAWS, 1), _seqs(DRAWS, top_p=0.95))
    drawn = set(tokens)
    assert len(drawn) > 1000 and max(drawn) < vocab - 500


def test_large_vocabulary_draws_land_on_the_likely_tokens_only() -> None:
    vocab = 1000  # not a multiple of the sampler's block: the padding is never drawn
    logits = torch.full((vocab,), float("-inf"))
    logits[[3, 510, 999]] = torch.tensor([0.0, 1.0, 2.0])
    tokens, errors, _ = Sampler()(torch.nan_to_num(logits, neginf=-1e4).repeat(DRAWS, 1), _seqs(DRAWS))
    assert not errors and set(tokens) == {3, 510, 999}
    expected = torch.softmax(torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64), dim=0)
    assert (_freq(tokens, vocab)[[3, 510, 999]] - expected).abs().max() < 0.03


def test_a_row_draws_the_same_token_alone_or_in_any_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 2000) * 2
    mixed = [Sequence(Request(f"m{i}", [1], seed=100 + i, temperature=t, top_k=k, top_p=p, min_p=m))
             for i, (t, k, p, m) in enumerate([(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.05), (0.7, 40, 1.0, 0.0),
                                               (0.9, 0, 0.9, 0.0), (1.2, 100, 0.8, 0.1), (0.0, 0, 1.0, 0.5),
                                               (0.5, 0, 1.0, 0.0), (1.0, 5, 0.5, 0.0)])]
    together, _, _ = Sampler()(logits, mixed)
    alone = [Sampler()(logits[i : i + 1], [s])[0][0] for i, s in enumerate(mixed)]
    assert together == alone
    assert together[0] == int(logits[0].argmax()) and together[5] == int(logits[5].argmax())
    reversed_, _, _ = Sampler()(logits.flip(0), mixed[::-1])
    assert reversed_[::-1] == together


def test_uniforms_from_seed_and_index_are_spread() -> None:
    us = [token_uniform(seed, index) for seed in range(50) for index in range(200)]
    assert all(0.0 <= u < 1.0 for u in us)
    assert abs(sum(us) / len(us) - 0.5) < 0.01
    assert abs(sum((u - 0.5) ** 2 for u in us) / len(us) - 1 / 12) < 0.005
    assert len(set(us)) == len(us)  # no two (seed, index) pairs here share a draw
    assert not math.isclose(token_uniform(7, 0), token_uniform(7, 1))


def test_half_precision_logits_sample_as_their_float32_upcast() -> None:
    """The runner hands over logits in the model's dtype: greedy and sampled rows come out as they would
    from the same logits in float32."""
    torch.manual_seed(1)
    logits = (torch.randn(6, 3000) * 4).to(torch.bfloat16)
    seqs = [Sequence(Request(f"h{i}", [1], seed=i, temperature=t, top_p=p))
            for i, (t, p) in enumerate([(0.0, 1.0), (1.0, 1.0), (0.7, 0.9), (0.0, 1.0), (1.3, 1.0), (0.5, 0.5)])]
    assert Sampler()(logits, seqs) == Sampler()(logits.float(), seqs)
    assert Sampler()(logits, seqs)[0][0] == int(logits.float()[0].argmax())


def test_large_finite_float16_logits_are_not_mistaken_for_non_finite() -> None:
    logits = torch.full((2, 5000), 60000.0, dtype=torch.float16)  # each finite; their sum is not in float16
    logits[1, 3] = float("nan")
    tokens, errors, _ = Sampler()(logits, _seqs(2, temperature=0.0))
    assert set(errors) == {1} and 0 <= tokens[0] < 5000


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 2.0), st.floats(0.001, 1.0), st.integers(0, 2**31 - 1),
                          st.integers(0, 2**63 - 1), st.integers(0, 5000)), min_size=1, max_size=12))
def test_any_accepted_sampling_settings_give_a_token_of_the_vocabulary(rows: list) -> None:
    """Whatever the API accepts (temperature 0-2, top_p from its floor to 1, any top_k, any folded seed, any
    token index) samples a token of the vocabulary; a nucleus at top_p's floor is the most likely token."""
    logits = torch.randn(len(rows), 700) * 5
    seqs = []
    for i, (t, p, k, seed, index) in enumerate(rows):
        accepted = GenerationRequest(prompt="x", temperature=t, top_p=p, top_k=k, seed=seed)
        seq = Sequence(accepted.tokenized(f"f{i}", [1]))  # the door's floors applied, as in the service
        seq.token_ids += [1] * index  # the index-th generated token
        seqs.append(seq)
    tokens, errors, _ = Sampler()(logits, seqs)
    assert not errors and all(0 <= tok < 700 for tok in tokens)
    for tok, row, (_, p, _, _, _) in zip(tokens, logits, rows):
        if p == 0.001:
            assert tok == int(row.argmax())


def test_rows_at_temperature_one_draw_alike_alone_and_beside_greedy_and_other_temperatures() -> None:
    """A batch where every row is at temperature 1 skips the division by it, and a batch without a greedy row skips
    the argmax: each row's token is still the one it draws among rows that need both."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(6, 49152, generator=g).to(dtype)
        alone = Sampler()(logits[:4], _seqs(4))[0]
        mixed = _seqs(4) + [Sequence(Request("hot", [1], seed=9, temperature=0.7)),
                            Sequence(Request("greedy", [1], temperature=0.0))]
        tokens, errors, _ = Sampler()(logits, mixed)
        assert not errors
        assert tokens[:4] == alone, dtype
        assert tokens[5] == int(logits[5].float().argmax())
