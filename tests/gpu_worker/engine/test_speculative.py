"""N-gram speculative decoding (SPECULATIVE=ngram): a request's tokens with it on are token for token those
with it off, greedy and seeded sampling alike, whatever trims its drafts (the step's budget, free blocks,
max_tokens, a stop token inside an accepted draft); and copying text takes fewer steps. The real default
model checks greedy decoding against transformers' own `generate` with drafts accepted."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_worker.engine import EngineConfig, LLMEngine
from gpu_worker.engine.block_manager import BlockManager
from gpu_worker.engine.ngram import NgramConfig, NgramIndex
from shared.schemas import Request
from tests.gpu_worker.engine.test_engine import prompt_ids, reference_model, run

SPEC = NgramConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
TEXT = "The quick brown fox jumps over the lazy dog, and the lazy dog sleeps. "


# --- the n-gram index -----------------------------------------------------------------------------


def _reference(tokens: list[int], most: int, c: NgramConfig) -> list[int]:
    """The proposal by brute force: the longest suffix that occurred before, at its most recent place."""
    for n in range(min(c.prompt_lookup_max, len(tokens)), c.prompt_lookup_min - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for j in range(len(tokens) - 1, n - 1, -1):
            if tokens[j - n : j] == suffix:
                return tokens[j : j + min(most, c.num_speculative_tokens)] if most > 0 else []
    return []


def test_index_proposes_what_followed_the_longest_most_recent_match() -> None:
    c = NgramConfig(3, 1, 3)
    # [2, 3] ended last at 7 (then 5, 7, 2), but the longer [1, 2, 3] ended at 3 (then 4, 8, 2): longest wins
    assert NgramIndex(c).propose([1, 2, 3, 4, 8, 2, 3, 5, 7, 1, 2, 3], 8) == [4, 8, 2]
    assert NgramIndex(c).propose([1, 2, 3, 4, 9, 2, 3, 5, 7, 2, 3], 8) == [5, 7, 2]  # most recent [2, 3]
    assert NgramIndex(c).propose([1, 2, 3, 4, 1, 2, 3], 2) == [4, 1]  # at most `most`
    assert NgramIndex(c).propose([1, 2, 3, 4], 8) == []  # its own suffix never matches itself
    assert NgramIndex(c).propose([5, 5], 0) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.lists(st.integers(1, 6), min_size=1, max_size=6),
       st.integers(1, 3), st.integers(0, 2))
def test_index_fed_step_by_step_proposes_as_brute_force(tokens: list[int], cuts: list[int], lo: int,
                                                         extra: int) -> None:
    c = NgramConfig(3, lo, lo + extra)
    index, at = NgramIndex(c), 1
    for cut in cuts:  # the sequence grows by a few tokens between proposals, as accepted drafts make it
        at = min(len(tokens), at + cut)
        assert index.propose(tokens[:at], 5) == _reference(tokens[:at], 5, c)


# --- the engine, tiny model: outputs unchanged whatever trims a draft --------------------------------


@pytest.fixture(scope="module")
def engines(tiny_model_dir: str) -> tuple[LLMEngine, LLMEngine]:
    """The same tiny model without and with speculation."""
    return (LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", max_num_seqs=16)),
            LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", max_num_seqs=16, speculative=SPEC)))


@pytest.fixture(scope="module")
def copy_prompts(tiny_model_dir: str, engines: tuple[LLMEngine, LLMEngine]) -> list[list[int]]:
    """Prompts that hold what the tiny model says next: each chat prompt, its greedy continuation, and the
    prompt again (random weights otherwise repeat nothing, and no draft would ever be proposed)."""
    prompts = [prompt_ids(tiny_model_dir, f"Repeat {i}: " + TEXT * (1 + i % 3)) for i in range(8)]
    # through both engines: each then holds the same prefix cache (a prompt read partly from the cache is summed in
    # another order than one computed whole, ~1e-7 apart in float32, enough to flip a seeded draw on a boundary)
    said, _ = _both(engines, _reqs(prompts, temperature=0.0, max_tokens=24))
    return [p + said[f"r{i}"] + p for i, p in enumerate(prompts)]


def _reqs(prompts: list[list[int]], **kw: object) -> list[Request]:
    return [Request(f"r{i}", p, **{"max_tokens": 40, "ignore_eos": True, **kw}) for i, p in  # type: ignore[arg-type]
            enumerate(prompts)]


def _both(engines: tuple[LLMEngine, LLMEngine], reqs: list[Request]) -> tuple[dict[str, list[int]], int]:
    """Each request's tokens without and with speculation (asserted equal), and the draft tokens kept."""
    off, on = engines
    kept = on.num_accepted_tokens
    plain, spec = run(off, reqs), run(on, reqs)
    assert spec == plain
    return plain, on.num_accepted_tokens - kept


def test_greedy_tokens_unchanged_and_drafts_kept(engines: tuple[LLMEngine, LLMEngine],
                                                 copy_prompts: list[list[int]]) -> None:
    _, kept = _both(engines, _reqs(copy_prompts, temperature=0.0))
    assert kept > 0  # (random weights copy little: the real model's test below counts the steps saved)


@pytest.mark.parametrize("kw", [{"temperature": 1.0}, {"temperature": 0.6, "top_p": 0.9},
                                {"temperature": 0.8, "top_k": 5}])
def test_seeded_sampling_unchanged(engines: tuple[LLMEngine, LLMEngine], copy_prompts: list[list[int]],
                                   kw: dict[str, float]) -> None:
    reqs = [Request(f"s{i}", copy_prompts[i % 8], max_tokens=32, ignore_eos=True, seed=100 + i, **kw)  # type: ignore[arg-type]
            for i in range(12)]
    _both(engines, reqs)


def test_stop_token_inside_a_draft_ends_there(engines: tuple[LLMEngine, LLMEngine],
                                              copy_prompts: list[list[int]]) -> None:
    plain, _ = _both(engines, _reqs(copy_prompts[:1], temperature=0.0))
    tokens = plain["r0"]
    stop = tokens[12]
    at = tokens.index(stop)
    on = engines[1]
    for e in engines:
        e.add_request(Request("stop", copy_prompts[0], max_tokens=40, temperature=0.0, ignore_eos=True,
                              stop_token_ids=[stop]))
    ends = {}
    for i, e in enumerate(engines):
        got: list[int] = []
        while e.has_unfinished():
            for o in e.step():
                got += o.token_ids
                ends[i] = o.finish_reason or ends.get(i)
        assert got == tokens[: at + 1] and ends[i] == "stop"
    assert on.num_draft_tokens > 0


@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_max_tokens_never_passed(engines: tuple[LLMEngine, LLMEngine], copy_prompts: list[list[int]],
                                 n: int) -> None:
    plain, _ = _both(engines, _reqs(copy_prompts, temperature=0.0, max_tokens=n))
    assert all(len(t) == n for t in plain.values())


def test_logprobs_follow_every_kept_token(engines: tuple[LLMEngine, LLMEngine],
                                          copy_prompts: list[list[int]]) -> None:
    got = []
    for e in engines:
        e.add_request(Request("lp", copy_prompts[2], max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2))
        tokens, chosen, tops = [], [], []
        while e.has_unfinished():
            for o in e.step():
                tokens += o.token_ids
                assert o.logprobs is not None and len(o.logprobs) == len(o.token_ids)
                chosen += o.logprobs.chosen
                tops += o.logprobs.top_ids
        got.append((tokens, chosen, tops))
    (t0, c0, k0), (t1, c1, k1) = got
    assert t0 == t1 and k0 == k1 and len(c1) == 24
    assert torch.allclose(torch.tensor(c0), torch.tensor(c1), atol=1e-4)


def test_drafts_trimmed_by_budget_and_blocks(tiny_model_dir: str, engines: tuple[LLMEngine, LLMEngine],
                                             copy_prompts: list[list[int]]) -> None:
    """A step budget barely above one token per sequence, and a KV pool so small that sequences are
    preempted: drafts shrink or vanish, the tokens do not change."""
    reqs = _reqs(copy_prompts + copy_prompts, temperature=0.0, max_tokens=24)
    plain = run(engines[0], reqs)
    tight = LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", max_num_seqs=16,
                                   max_num_batched_tokens=20, speculative=SPEC))
    assert run(tight, reqs) == plain and tight.num_draft_tokens > 0
    small = LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", max_num_seqs=16, speculative=SPEC))
    small.blocks = small.scheduler.blocks = BlockManager(40, small.runner.block_size)
    assert run(small, reqs) == plain
    assert small.scheduler.num_preemptions > 0 and small.num_draft_tokens > 0


def test_shaped_logits_do_not_speculate(engines: tuple[LLMEngine, LLMEngine],
                                        copy_prompts: list[list[int]]) -> None:
    """Penalties depend on every token before: a draft's rows could not apply them, so such requests
    decode one token a step (and are unchanged)."""
    on = engines[1]
    drafted = on.num_draft_tokens
    _both(engines, _reqs(copy_prompts[:4], temperature=0.0, repetition_penalty=1.2))
    assert on.num_draft_tokens == drafted


# --- the real default model ---------------------------------------------------------------------------


def test_real_model_copying_matches_generate_in_fewer_steps(model_path: str) -> None:
    engine = LLMEngine(EngineConfig(model=model_path, dtype="float32", max_num_seqs=4, speculative=SPEC))
    prompt = prompt_ids(model_path, "Copy the following text word for word:\n\n" + TEXT * 3)
    steps: list[set[str]] = []
    out = run(engine, [Request("copy", prompt, max_tokens=48, temperature=0)], steps_log=steps)["copy"]
    with torch.inference_mode():
        ref = reference_model(model_path).generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False,
                                                   pad_token_id=2)[0, len(prompt):].tolist()
    assert out == ref[: len(out)] and len(out) >= 24
    assert len(steps) * 2 < len(out) and engine.num_accepted_tokens * 2 > len(out)


# --- drafts in the step's budget ------------------------------------------------------------------


def test_drafts_take_only_what_prefill_leaves_of_a_step() -> None:
    """A draft is a bet: a prompt being prefilled gets the step's budget first (its first token waits on it), the
    drafts what it leaves; with no prompt to prefill, they are kept."""
    from gpu_worker.engine.scheduler import Scheduler
    from gpu_worker.engine.sequence import Sequence
    from tests.gpu_worker.engine.test_scheduler_fair import _run_step

    sched = Scheduler(BlockManager(num_blocks=256, block_size=4), 8, 32, 1024)
    decoding = [Sequence(Request(f"d{i}", [10 + i, 1, 2], max_tokens=64)) for i in range(4)]
    for s in decoding:
        sched.add(s)
    _run_step(sched)  # prefilled, each with its first token: decoding from here
    prompt = Sequence(Request("long", list(range(100, 160)), max_tokens=4))
    sched.add(prompt)
    for _ in range(2):
        for s in decoding:
            s.draft = [5, 5, 5, 5]
        batch, _ = sched.schedule()
        assert batch.chunks == [(prompt, 32 - len(decoding))] and all(not s.draft for s in decoding)
        prompt.num_computed += 32 - len(decoding)
        for s in decoding:
            s.num_computed = s.num_tokens
            s.token_ids.append(7)
    for s in decoding:
        s.draft = [5, 5, 5, 5]
    batch, _ = sched.schedule()  # the prompt's last 4 tokens, and room for every draft
    assert batch.chunks == [(prompt, 4)] and all(s.draft == [5, 5, 5, 5] for s in decoding)
