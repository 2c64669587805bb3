"""The paged KV cache: blocks by tokens, not by the longest row; prefix caching; no leaks."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.engine import EngineConfig, LLMEngine
from gpu_worker.engine.block_manager import NULL_BLOCK, BlockManager
from gpu_worker.engine.sequence import Sequence
from shared.schemas import Request
from tests.gpu_worker.engine.test_engine import reference_model


def _seq(name: str, ids: list[int]) -> Sequence:
    return Sequence(Request(name, ids))


def _drive(engine: LLMEngine, reqs: list[Request]) -> tuple[dict[str, list[int]], int]:
    out: dict[str, list[int]] = {r.id: [] for r in reqs}
    for r in reqs:
        engine.add_request(r)
    most = 0
    while engine.has_unfinished():
        for o in engine.step():
            assert o.error is None, o.error
            out[o.id].extend(o.token_ids)
        most = max(most, engine.num_running)
    return out, most


def test_blocks_are_shared_by_prefix_and_evicted_least_recently_released() -> None:
    bm = BlockManager(num_blocks=9, block_size=4)  # 8 usable
    a = _seq("a", list(range(10)))  # 3 blocks: two full, one partial
    assert bm.allocate(a) and len(a.block_table) == 3 and NULL_BLOCK not in a.block_table
    a.num_computed = 10
    bm.register(a)
    b = _seq("b", list(range(8)) + [99, 98, 97])  # shares the two full blocks
    assert bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.num_computed == 8
    assert bm.num_used == 4
    bm.free(a)
    bm.free(b)
    assert bm.num_used == 0 and bm.num_free == 8
    # a prompt that is exactly the cached blocks still computes its last token: one block is not taken
    c = _seq("c", list(range(8)))
    assert bm.allocate(c) and c.num_computed == 4
    bm.free(c)
    # filling the pool evicts the cached blocks, the least recently released first
    d = _seq("d", list(range(100, 128)))  # 7 blocks
    assert bm.allocate(d)
    assert len(bm.by_hash) == 1  # of the two cached blocks, one survives
    e = _seq("e", list(range(200, 208)))  # 2 blocks: only one free
    assert not bm.allocate(e) and not e.block_table


def test_a_hash_collision_serves_nothing() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    a = _seq("a", [1, 2, 3])
    assert bm.allocate(a)
    a.num_computed = 3
    bm.register(a)
    block = a.block_table[0]
    bm.block_tokens[block] = (7, 7)  # as if another token run had the same hash
    b = _seq("b", [1, 2, 5])
    assert bm.allocate(b) and b.num_computed == 0 and b.block_table[0] != block


def test_mixed_lengths_are_admitted_by_their_tokens(tiny_model_dir: str) -> None:
    """One 1,500-token request among thirty short ones: a dense cache sized for the long row would
    hold two rows in this budget; blocks hold all 31 at once."""
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", max_num_seqs=64, kv_cache_mb=2,
                                    max_num_batched_tokens=4096, max_model_len=2048))
    assert engine.blocks.usable_blocks * engine.blocks.block_size < 2 * 1500 * 2
    reqs = [Request("long", [5 + i % 1000 for i in range(1500)], max_tokens=8, temperature=0, ignore_eos=True)]
    reqs += [Request(f"s{i}", [10 + i] * 50, max_tokens=8, temperature=0, ignore_eos=True) for i in range(30)]
    out, most = _drive(engine, reqs)
    assert most == 31
    assert all(len(v) == 8 for v in out.values())
    assert engine.blocks.num_used == 0  # every block given back


def test_prefix_cache_hits_give_the_same_tokens(tiny_model_dir: str) -> None:
    """Requests sharing a long system prompt reuse its blocks and produce what they produce without
    the cache (float32, greedy), and what transformers' `generate` produces."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{tiny_model_dir}/tokenizer.json")
    system = "You are a careful assistant. " * 30
    prompts = [tok.encode(system + q).ids
               for q in ("What is the capital of France?", "Name a large ocean.", "Describe rain")]
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", max_num_seqs=8))

    def reqs(tag: str) -> list[Request]:
        return [Request(f"{tag}{i}", list(p), max_tokens=12, temperature=0, ignore_eos=True)
                for i, p in enumerate(prompts)]

    engine.blocks.prefix_caching = False
    plain, _ = _drive(engine, reqs("plain"))
    assert engine.blocks.hits == 0
    engine.blocks.prefix_caching = True
    _drive(engine, reqs("warm")[:1])  # the first fills the cache
    hits_before = engine.blocks.hits
    cached, _ = _drive(engine, reqs("hit"))
    assert engine.blocks.hits - hits_before >= 3 * 150  # the system prompt, three times
    assert [cached[f"hit{i}"] for i in range(3)] == [plain[f"plain{i}"] for i in range(3)]
    assert len({tuple(v) for v in plain.values()}) == 3  # the rows differ: one served another's blocks would show
    with torch.inference_mode():
        ref = reference_model(engine.runner.hf_model.name_or_path).generate(
            torch.tensor([prompts[1]]), max_new_tokens=12, do_sample=False, pad_token_id=2)
    ref = ref[0, len(prompts[1]):].tolist()
    assert cached["hit1"][: len(ref)] == ref


PREEMPT_CFG = dict(dtype="float32", max_num_seqs=16, max_model_len=2048)
PREEMPT_PROMPTS = [[20 + i] * (40 + 7 * i) for i in range(12)]


@pytest.fixture(scope="module")
def preempt_ref(tiny_model_dir: str) -> dict[str, list[int]]:
    """Each of PREEMPT_PROMPTS' 24 greedy tokens, run as the only request."""
    alone = LLMEngine(EngineConfig(model=tiny_model_dir, **PREEMPT_CFG))  # type: ignore[arg-type]
    return {f"r{i}": _drive(alone, [Request(f"r{i}", p, max_tokens=24, temperature=0, ignore_eos=True)])[0][f"r{i}"]
            for i, p in enumerate(PREEMPT_PROMPTS)}


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preempted_sequences_resume_to_the_same_tokens(tiny_model_dir: str, preempt_ref: dict[str, list[int]],
                                                       prefix_caching: bool) -> None:
    """A pool too small for every sequence at once: the newest are preempted by blocks and finish
    with the tokens they produce alone."""
    small = LLMEngine(EngineConfig(model=tiny_model_dir, **PREEMPT_CFG, kv_cache_mb=8,  # type: ignore[arg-type]
                                   prefix_caching=prefix_caching))
    small.blocks = small.scheduler.blocks = BlockManager(40, small.runner.block_size, prefix_caching)
    out, _ = _drive(small, [Request(f"r{i}", p, max_tokens=24, temperature=0, ignore_eos=True)
                            for i, p in enumerate(PREEMPT_PROMPTS)])
    assert small.scheduler.num_preemptions > 0
    assert out == preempt_ref
    assert small.blocks.num_used == 0


def test_an_engine_whose_cache_cannot_hold_one_context_refuses_to_start(tiny_model_dir: str) -> None:
    """A request the door accepts (up to MAX_MODEL_LEN) must fit the cache alone, or it would fail part-way."""
    with pytest.raises(ValueError, match="KV_CACHE_MB"):
        LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", max_num_seqs=1, kv_cache_mb=1,
                               max_model_len=100_000))
