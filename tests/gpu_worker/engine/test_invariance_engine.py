"""Batch invariance, the engine's: a request's logits (every sampled row's bits) and so its tokens, greedy and seeded,
are those it gets alone with nothing cached, whatever else runs, however its prompt is chunked, whether its prefix
came from the cache (its own earlier prompt, or the next turn's prompt holding an earlier answer), whether it was
preempted and computed again or resumed from tokens another worker produced, with speculative decoding on, and in
another process on another thread count. On a random model of the default model's layer shapes (its down projection
reduces over 1,536), in each dtype the build takes; then as a user would see it, on the real default model: the same
text alone and among other jobs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from gpu_worker.engine import EngineConfig, LLMEngine
from gpu_worker.engine.block_manager import BlockManager
from gpu_worker.engine.device import cpu_has_bf16
from gpu_worker.engine.logprobs import Logprobs
from gpu_worker.engine.ngram import NgramConfig
from gpu_worker.engine.sampler import Sampler
from gpu_worker.engine.sequence import Sequence
from shared.schemas import Request
from tests.gpu_worker.engine.test_engine import QUESTIONS, prompt_ids, run

DTYPES = ["float32", *(["bfloat16"] if cpu_has_bf16() else [])]
NEW = 24


class Recorder:
    """The engine's sampler, keeping each sampled row's logits by request and token index (a draft row's by the
    index it would have; a rejected draft's are replaced when that index is sampled again)."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.rows: dict[tuple[str, int], torch.Tensor] = {}

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], ahead: list[int] | None = None,
                 ) -> tuple[list[int], dict[int, str], list[Logprobs | None]]:
        for i, s in enumerate(seqs):
            self.rows[(s.id, s.num_generated + (ahead[i] if ahead else 0))] = logits[i].clone()
        return self.sampler(logits, seqs, ahead)


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random 2-layer Llama with the default model's layer shapes (hidden 576, MLP 1,536, 9 heads over 3 KV heads of
    64) and a small vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("wide-llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(out)
    return str(out)


def _engine(model: str, dtype: str, **kw: object) -> tuple[LLMEngine, Recorder]:
    eng = LLMEngine(EngineConfig(**{"model": model, "dtype": dtype, "max_num_seqs": 32, **kw}))  # type: ignore[arg-type]
    rec = Recorder(eng.runner.sampler)
    eng.runner.sampler = rec  # type: ignore[assignment]
    return eng, rec


def _prompts() -> list[list[int]]:
    """(17 tokens: one past a block, the one left to compute when it is sent again with its first block cached)"""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 4096, (n,), generator=g).tolist() for n in (37, 5, 61, 17)]


def _mine(prompts: list[list[int]]) -> list[Request]:
    """Two greedy requests and two seeded (temperature 1, top-p 0.9)."""
    return [Request(f"m{i}", p, max_tokens=NEW, ignore_eos=True, temperature=0.0 if i % 2 else 1.0, top_p=0.9,
                    seed=11 + i) for i, p in enumerate(prompts)]


def _others(n: int) -> list[Request]:
    g = torch.Generator().manual_seed(8)
    return [Request(f"o{i}", torch.randint(3, 4096, (int(torch.randint(2, 90, (1,), generator=g)),),
                                           generator=g).tolist(), max_tokens=8 + 3 * i, ignore_eos=True,
                    temperature=0.8, seed=i) for i in range(n)]


@pytest.fixture(scope="module", params=DTYPES)
def baseline(request: pytest.FixtureRequest, wide_model_dir: str) -> tuple[str, dict[str, list[int]], Recorder]:
    """Each of `_mine` run alone, in an engine that caches nothing: its tokens and its rows' logits."""
    eng, rec = _engine(wide_model_dir, request.param, prefix_caching=False)
    tokens = {}
    for r in _mine(_prompts()):
        tokens |= run(eng, [r])
    return request.param, tokens, rec


def _same(base: Recorder, got: Recorder, rid: str, start: int = 0) -> None:
    for i in range(start, NEW):
        assert torch.equal(got.rows[(rid, i)], base.rows[(rid, i)]), (rid, i)


def test_among_other_requests_and_chunked(baseline: tuple[str, dict[str, list[int]], Recorder],
                                          wide_model_dir: str) -> None:
    """Among 20 others of 2-89 tokens arriving over the first steps; then with 16 tokens a step beside a decoding
    request, each prompt cut in chunks of what is left of the step."""
    dtype, tokens, base = baseline
    for kw in ({}, {"max_num_batched_tokens": 16}):
        eng, rec = _engine(wide_model_dir, dtype, **kw)
        others = _others(20 if not kw else 1)
        arrivals = {o.id: i % 4 for i, o in enumerate(others)} | {f"m{i}": 1 + 2 * i for i in range(4)}
        out = run(eng, [*others, *_mine(_prompts())], arrivals)
        for rid in tokens:
            assert out[rid] == tokens[rid], (kw, rid)
            _same(base, rec, rid)


def test_from_the_prefix_cache(baseline: tuple[str, dict[str, list[int]], Recorder], wide_model_dir: str) -> None:
    """Each request again once its first run is cached (its prompt's full blocks hit); and a next turn whose prompt
    holds the first answer (blocks past the first prompt computed as prompt, as with nothing cached)."""
    dtype, tokens, base = baseline
    eng, rec = _engine(wide_model_dir, dtype)
    first = run(eng, _mine(_prompts()))
    hits = eng.blocks.hits
    again = run(eng, _mine(_prompts()))
    assert eng.blocks.hits > hits and again == first == tokens
    for rid in tokens:
        _same(base, rec, rid)
    turn = [Request(f"t{i}", p + tokens[f"m{i}"] + [5, 6, 7], max_tokens=NEW, ignore_eos=True, temperature=0.0)
            for i, p in enumerate(_prompts())]
    cached = run(eng, turn)
    fresh, _ = _engine(wide_model_dir, dtype, prefix_caching=False)
    assert cached == run(fresh, turn)


def test_preempted_resumed_and_speculative(baseline: tuple[str, dict[str, list[int]], Recorder],
                                           wide_model_dir: str) -> None:
    """Preempted in a pool of 8 blocks (and the null one) and computed again; resumed from its first 10 tokens (a
    redelivered job); with n-gram drafts (a random model repeats itself: drafts are accepted)."""
    dtype, tokens, base = baseline
    small, rec = _engine(wide_model_dir, dtype, max_num_seqs=8)
    small.blocks = small.scheduler.blocks = BlockManager(9, small.runner.block_size, True, True)
    out = run(small, [*_mine(_prompts()), *_others(4)], {f"m{i}": i for i in range(4)})
    assert small.scheduler.num_preemptions > 0
    for rid in tokens:
        assert out[rid] == tokens[rid], rid
        _same(base, rec, rid)
    eng, rec = _engine(wide_model_dir, dtype)
    resumed = run(eng, [Request(r.id, r.prompt_ids, max_tokens=NEW, ignore_eos=True, temperature=r.temperature,
                                top_p=0.9, seed=r.seed, resume_ids=tokens[r.id][:10]) for r in _mine(_prompts())])
    for rid in tokens:
        assert tokens[rid][:10] + resumed[rid] == tokens[rid], rid
        _same(base, rec, rid, start=10)
    spec, rec = _engine(wide_model_dir, dtype, speculative=NgramConfig(4, 1, 3))
    out = run(spec, [*_mine(_prompts()), *_others(6)], {f"m{i}": i for i in range(4)})
    assert spec.num_accepted_tokens > 0
    for rid in tokens:
        assert out[rid] == tokens[rid], rid
        _same(base, rec, rid)


def test_another_process_on_one_thread(baseline: tuple[str, dict[str, list[int]], Recorder],
                                       wide_model_dir: str) -> None:
    """Another worker process of the same host, its torch on another number of threads, the four requests together:
    the same tokens."""
    dtype, tokens, _ = baseline
    threads = 1 if torch.get_num_threads() > 1 else 2
    code = ("import json, sys, torch; torch.set_num_threads(int(sys.argv[3])); "
            "from tests.gpu_worker.engine.test_invariance_engine import _engine, _mine, _prompts; "
            "from tests.gpu_worker.engine.test_engine import run; "
            "eng, _ = _engine(sys.argv[1], sys.argv[2], prefix_caching=False); "
            "print(json.dumps(run(eng, _mine(_prompts()))))")
    out = subprocess.run([sys.executable, "-c", code, wide_model_dir, dtype, str(threads)], capture_output=True,
                         text=True, timeout=300, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == tokens


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_real_model_same_text_alone_and_among_other_jobs(model_path: str, dtype: str) -> None:
    """As a user checks it: 2 greedy and 2 seeded chat prompts (temperature 1, top-p 0.9), each alone, then together
    among 16 other jobs of other lengths arriving over the first steps, then with 32 tokens a step (prompts cut in
    chunks beside decoding rows) and their prompts cached: the same tokens."""
    prompts = [prompt_ids(model_path, q) for q in QUESTIONS[:4]]
    others = [Request(f"o{i}", prompt_ids(model_path, "Tell me about " + "the sea and its tides " * (1 + i % 6)),
                      max_tokens=6 + 2 * i, ignore_eos=True, temperature=0.8, seed=i) for i in range(16)]
    eng = LLMEngine(EngineConfig(model=model_path, dtype=dtype, max_num_seqs=32, prefix_caching=False))
    alone = {}
    for r in _mine(prompts):
        alone |= run(eng, [r])
    out = run(eng, [*others, *_mine(prompts)], {o.id: i % 3 for i, o in enumerate(others)} | {
        f"m{i}": 1 + i for i in range(4)})
    assert {rid: out[rid] for rid in alone} == alone
    chunked = LLMEngine(EngineConfig(model=model_path, dtype=dtype, max_num_seqs=32, max_num_batched_tokens=32))
    run(chunked, _mine(prompts))  # cached from here on
    out = run(chunked, [*others[:4], *_mine(prompts)], {f"m{i}": 1 + i for i in range(4)})
    assert chunked.blocks.hits > 0 and {rid: out[rid] for rid in alone} == alone

