"""The engine in process: batching, preemption, chunked prefill, sampling, abort. What holds whatever
the weights (a request's tokens are the same alone, in any batch, prefilled in chunks, preempted,
resumed) runs on the tiny random model in float32; the real default model checks greedy decoding
against transformers' own `generate` and that its answer ends on EOS."""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache

import pytest
import torch

from gpu_worker.engine import EngineConfig, LLMEngine, StepBatch
from gpu_worker.engine.block_manager import BlockManager
from gpu_worker.engine.logprobs import Logprobs
from gpu_worker.engine.sampler import Sampler
from gpu_worker.engine.sequence import Sequence
from gpu_worker.engine.step import StepOutput
from shared.jobs import FinishReason
from shared.schemas import GenerationRequest, Request
from workers.tokenizer.prompt import PromptBuilder

QUESTIONS = [
    "What is the capital of France?", "Name a large ocean.", "Why is the sky blue?", "Say something kind.",
    "What do bees make?", "Describe rain.", "How many legs does a spider have?", "What is a prime number?",
]


@cache
def _builder(model_dir: str) -> PromptBuilder:
    return PromptBuilder(model_dir)


def prompt_ids(model_dir: str, question: str) -> list[int]:
    pb = _builder(model_dir)
    text = pb.render(GenerationRequest(messages=[{"role": "user", "content": question}]))
    return pb.encode_batch([text], [False])[0]


class SeenLogits(Sampler):
    """The runner's sampler, keeping (float32) the logits `ModelRunner.run` hands it: what a step samples from."""

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], ahead: list[int] | None = None,
                 ) -> tuple[list[int], dict[int, str], list[Logprobs | None]]:
        self.logits = logits.float().clone()
        return super().__call__(logits, seqs, ahead)


def step_logits(engine: LLMEngine, batch: StepBatch) -> torch.Tensor:
    """The logits `ModelRunner.run` samples from for this batch (decode rows, then completed chunks)."""
    runner = engine.runner
    seen = runner.sampler = SeenLogits(runner.eos_token_ids)
    runner.run(batch)
    return seen.logits


def run(engine: LLMEngine, reqs: list[Request], arrivals: dict[str, int] | None = None,
        steps_log: list[set[str]] | None = None) -> dict[str, list[int]]:
    """Drive the engine to completion; requests join at the step given in `arrivals`. `steps_log`
    gets, per step, the requests that received a token."""
    out: dict[str, list[int]] = {r.id: [] for r in reqs}
    pending = sorted(reqs, key=lambda r: (arrivals or {}).get(r.id, 0))
    step = 0
    while pending or engine.has_unfinished():
        while pending and (arrivals or {}).get(pending[0].id, 0) <= step:
            engine.add_request(pending.pop(0))
        outs = engine.step()
        for o in outs:
            assert o.error is None, o.error
            out.setdefault(o.id, []).extend(o.token_ids)
        if steps_log is not None:
            steps_log.append({o.id for o in outs if o.token_ids})
        step += 1
    return out


@cache
def reference_model(path: str) -> torch.nn.Module:
    """transformers' own model, float32, loaded apart from any engine (an engine empties the matrices of the
    model it takes over)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def greedy(rid: str, prompt: list[int], n: int = 32, **kw: object) -> Request:
    return Request(rid, prompt, max_tokens=n, temperature=0, ignore_eos=True, **kw)  # type: ignore[arg-type]


# --- the real default model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_engine(model_path: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_path, dtype="float32", max_num_seqs=4))


@pytest.fixture(scope="module")
def real_answer(real_engine: LLMEngine, model_path: str) -> tuple[list[int], list[int]]:
    """A chat prompt for the real model and the engine's greedy answer to it, up to its own end."""
    prompt = prompt_ids(model_path, QUESTIONS[0])
    answer = run(real_engine, [Request("real", prompt, max_tokens=40, temperature=0)])["real"]
    assert not real_engine.has_unfinished()
    return prompt, answer


def test_greedy_matches_transformers_generate(model_path: str, real_answer: tuple[list[int], list[int]]) -> None:
    prompt, answer = real_answer
    with torch.inference_mode():
        ref = reference_model(model_path).generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False,
                                                   pad_token_id=2)[0, len(prompt):].tolist()
    assert len(ref) >= 5 and answer == ref


def test_greedy_answer_ends_on_eos(real_engine: LLMEngine, real_answer: tuple[list[int], list[int]]) -> None:
    _, answer = real_answer
    assert len(answer) < 40 and answer[-1] in real_engine.eos_token_ids
    assert not any(t in real_engine.eos_token_ids for t in answer[:-1])


# --- the tiny model: what holds for any weights ------------------------------------------------------


@pytest.fixture(scope="module")
def shared_engine(tiny_model_dir: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", max_num_seqs=32))


@pytest.fixture
def engine(shared_engine: LLMEngine) -> Iterator[LLMEngine]:
    """The module's tiny-model engine; every test leaves it with no request in flight."""
    assert not shared_engine.has_unfinished()
    yield shared_engine
    assert not shared_engine.has_unfinished()


@pytest.fixture(scope="module")
def prompts(tiny_model_dir: str) -> list[list[int]]:
    return [prompt_ids(tiny_model_dir, q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def alone(shared_engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's 32 greedy tokens, run as the only request."""
    return [run(shared_engine, [greedy(f"alone{i}", p)])[f"alone{i}"] for i, p in enumerate(prompts)]


def test_staggered_batch_equals_batch_of_one(engine: LLMEngine, prompts: list[list[int]],
                                             alone: list[list[int]]) -> None:
    reqs = [greedy(f"s{i}", prompts[i % 8]) for i in range(16)]
    out = run(engine, reqs, arrivals={f"s{i}": 3 * i for i in range(16)})
    for i in range(16):
        assert out[f"s{i}"] == alone[i % 8], i


def test_preemption_under_small_kv_budget(tiny_model_dir: str, prompts: list[list[int]],
                                          alone: list[list[int]]) -> None:
    small = LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", max_num_seqs=16))
    small.blocks = small.scheduler.blocks = BlockManager(30, small.runner.block_size)  # ~ 4 sequences' worth
    reqs = [greedy(f"p{i}", prompts[i % 8]) for i in range(16)]
    out = run(small, reqs, arrivals={f"p{i}": i for i in range(16)})
    assert small.scheduler.num_preemptions > 0
    for i in range(16):
        assert out[f"p{i}"] == alone[i % 8], i
    assert small.blocks.num_used == 0


def test_chunked_prefill_equals_whole_prefill(tiny_model_dir: str, engine: LLMEngine) -> None:
    long_prompt = prompt_ids(tiny_model_dir, "Summarise this: " + "the quick brown fox jumps over the lazy dog. " * 30)
    assert len(long_prompt) > 64 * 3
    whole = run(engine, [greedy("w", long_prompt, 16)])["w"]
    chunked_engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", max_num_seqs=4,
                                            max_num_batched_tokens=64))
    running = greedy("r", prompt_ids(tiny_model_dir, "Count to ten."), 40)
    chunked_engine.add_request(running)
    chunked_engine.step()
    log: list[set[str]] = []
    out = run(chunked_engine, [greedy("c", long_prompt, 16)], steps_log=log)
    assert out["c"] == whole
    # the long prompt is prefilled over several steps, and the running sequence decodes in each of them
    first = next(i for i, got in enumerate(log) if "c" in got)
    assert first >= len(long_prompt) // 64
    assert all("r" in got for got in log[: first + 1])


def test_seed_reproducible_whatever_the_batch(engine: LLMEngine, prompts: list[list[int]]) -> None:
    def sampled(i: str, seed: int = 1234) -> Request:
        return Request(i, prompts[1], max_tokens=24, temperature=0.9, top_p=0.9, top_k=50, seed=seed,
                       ignore_eos=True)

    a = run(engine, [sampled("x1")])["x1"]
    others = [Request(f"o{i}", prompts[i], max_tokens=24, temperature=1.0, seed=i) for i in range(2, 8)]
    b = run(engine, [*others, sampled("x2")], arrivals={"x2": 2})["x2"]
    assert len(a) == 24 and a == b
    c = run(engine, [sampled("x3", seed=99)])["x3"]
    assert c != a


def test_abort_frees_slot_next_step(engine: LLMEngine, prompts: list[list[int]]) -> None:
    engine.add_request(Request("a1", prompts[0], max_tokens=100, ignore_eos=True))
    engine.add_request(Request("a2", prompts[1], max_tokens=100, ignore_eos=True))
    for _ in range(2):  # a2 shares a1's chat-template prefix: on a cold cache it waits a step to reuse a1's blocks
        engine.step()
    assert engine.num_running == 2
    assert engine.abort_request("a1")
    outs = engine.step()
    assert any(o.id == "a1" and o.finish_reason is FinishReason.cancelled for o in outs)
    assert engine.num_running == 1
    engine.add_request(Request("a3", prompts[2], max_tokens=5, temperature=0, ignore_eos=True))
    engine.step()
    assert engine.num_running == 2  # the freed slot is reused
    assert not engine.abort_request("missing")
    engine.abort_request("a2")
    engine.abort_request("a3")
    while engine.has_unfinished():
        engine.step()


def test_stop_token_ids_end_a_request_at_their_first_occurrence(engine: LLMEngine, prompts: list[list[int]],
                                                                alone: list[list[int]]) -> None:
    free = alone[0]
    stop_at = free[2]
    outs: list[StepOutput] = []
    engine.add_request(greedy("e2", prompts[0], stop_token_ids=(stop_at,)))
    while engine.has_unfinished():
        outs += engine.step()
    assert [t for o in outs for t in o.token_ids] == free[: free.index(stop_at) + 1]
    assert outs[-1].finish_reason is FinishReason.stop and outs[-1].finish_reason == "stop"


def test_resume_continues_identically(engine: LLMEngine, prompts: list[list[int]], alone: list[list[int]]) -> None:
    half = alone[3][:10]
    out = run(engine, [greedy("rs", prompts[3], resume_ids=half)])
    assert half + out["rs"] == alone[3]


def test_runner_matches_transformers_logits(tiny_model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = [5, 17, 99, 1000, 42, 7, 300]
    with torch.inference_mode():  # reference first: the runner takes the model over
        ref = model(torch.tensor([ids])).logits[0, -1]
    eng = LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32"), model=model)
    seq = Sequence(Request("t", ids))
    assert eng.blocks.allocate(seq)
    logits = step_logits(eng, StepBatch(decode=[], chunks=[(seq, len(ids))]))
    assert torch.allclose(logits[0], ref, atol=1e-4)


def prefill_then_decode(eng: LLMEngine, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of `ids` but the last prefilled as one chunk, then of the decode step for the last."""
    seq = Sequence(Request("t", ids[:-1]))
    assert eng.blocks.allocate(seq)
    prefill = step_logits(eng, StepBatch(decode=[], chunks=[(seq, len(ids) - 1)]))
    seq.num_computed = len(ids) - 1
    seq.token_ids.append(ids[-1])
    eng.blocks.append(seq)
    return prefill[0], step_logits(eng, StepBatch(decode=[seq], chunks=[]))[0]


def _tiny(arch: str) -> torch.nn.Module:
    import transformers

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, eos_token_id=2, pad_token_id=2)
    config_cls, model_cls = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),  # biases on q/k/v
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),  # per-head RMSNorm on q and k
        "gemma": ("GemmaConfig", "GemmaForCausalLM"),  # the same attribute names, other arithmetic
    }[arch]
    extra = {"head_dim": 16} if arch == "qwen3" else {}
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**common, **extra)).eval()
    if arch == "qwen2":
        for layer in model.model.layers:  # randomly initialised biases are zeros: make them matter
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    return model


def test_an_architecture_the_engine_does_not_compute_is_refused_not_run() -> None:
    """A Gemma has a Llama's attribute names (q_proj, gate_proj, input_layernorm, ...) but other arithmetic (its norms
    scale by 1 + weight, its embeddings by sqrt(hidden)): the engine used to load it and answer with other logits
    (argmax 181 against transformers' 254), without a word. Sliding-window attention past its window likewise."""
    with pytest.raises(ValueError, match="model_type 'gemma': the engine runs llama, mistral, qwen2, qwen3"):
        LLMEngine(EngineConfig(model="unused", dtype="float32"), model=_tiny("gemma"))
    mistral = _tiny("mistral")
    mistral.config.sliding_window = 64  # shorter than the 256 tokens the engine would serve
    with pytest.raises(ValueError, match="a window of 64 tokens.*MAX_MODEL_LEN to at most 64"):
        LLMEngine(EngineConfig(model="unused", dtype="float32"), model=mistral)
    LLMEngine(EngineConfig(model="unused", dtype="float32", max_model_len=64), model=_tiny("mistral"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_runner_prefill_and_decode_match_transformers(arch: str, dtype: str) -> None:
    """The fused layers (q/k/v and gate/up in one matrix, oneDNN weights in bf16) compute what the
    model's own forward computes, for a prefill chunk and for the decode step after it."""
    model = _tiny(arch).to(getattr(torch, dtype))
    ids = [5, 17, 99, 300, 42, 7, 301, 11]
    with torch.inference_mode():  # reference first: the runner takes the model over
        ref = model(torch.tensor([ids])).logits[0, -2:].float()
    eng = LLMEngine(EngineConfig(model="unused", dtype=dtype), model=model)
    prefill, decode = prefill_then_decode(eng, ids)
    tol = 1e-4 if dtype == "float32" else 0.03 * ref.abs().max().item()  # bf16: ~1% seen
    assert (prefill - ref[0]).abs().max().item() < tol
    assert (decode - ref[1]).abs().max().item() < tol
    if dtype == "float32":
        assert prefill.argmax() == ref[0].argmax() and decode.argmax() == ref[1].argmax()


@pytest.mark.parametrize("path", ["paged", "matmul-attention", "sdpa"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_batched_decode_of_uneven_rows_matches_transformers(arch: str, dtype: str, path: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode rows of different lengths in one step (block boundaries crossed; each attention path: read in
    place, or gathered with padding masked, through matmuls in bf16 on CPU or SDPA) each get the logits the
    model's own forward gives."""
    from gpu_worker.engine.models import llama

    monkeypatch.setattr(llama, "MATMUL_ATTENTION_MIN_READ", 0 if path == "matmul-attention" else 10**9)

    model = _tiny(arch).to(getattr(torch, dtype))
    prompts = [[(7 * i + 3 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((3, 17, 40, 16))]
    with torch.inference_mode():
        refs = [model(torch.tensor([ids])).logits[0, -1].float() for ids in prompts]
    eng = LLMEngine(EngineConfig(model="unused", dtype=dtype, cpu_kernels=path == "paged"), model=model)
    assert (eng.runner.model.paged_decode is not None) == (path == "paged")
    seqs = []
    for i, ids in enumerate(prompts):
        seq = Sequence(Request(f"r{i}", ids[:-1]))
        assert eng.blocks.allocate(seq)
        step_logits(eng, StepBatch(decode=[], chunks=[(seq, len(ids) - 1)]))
        seq.num_computed = len(ids) - 1
        seq.token_ids.append(ids[-1])
        eng.blocks.append(seq)
        seqs.append(seq)
    logits = step_logits(eng, StepBatch(decode=seqs, chunks=[]))
    for row, ref in zip(logits, refs):
        tol = 1e-4 if dtype == "float32" else 0.03 * ref.abs().max().item()
        assert (row - ref).abs().max().item() < tol
        if dtype == "float32":
            assert row.argmax() == ref.argmax()


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 40, 300])
def test_cpu_float32_gemm_computes_what_f_linear_does(rows: int) -> None:
    """float32 on CPU multiplies by a oneDNN-reordered copy of the weight: it must compute x @ w.T (+ bias,
    + residual) as F.linear does, at any row count, whatever row count the copy was prepared for."""
    from gpu_worker.engine.gemm import OneDnnGemm, choose_gemm

    layer_gemm, head_gemm = choose_gemm(torch.device("cpu"), torch.float32)
    if not isinstance(layer_gemm, OneDnnGemm):
        pytest.skip("this torch build has no oneDNN")
    torch.manual_seed(rows)
    w, b = torch.randn(96, 64), torch.randn(96)
    x, residual = torch.randn(rows, 64), torch.randn(rows, 96)
    expect = torch.nn.functional.linear(x, w, b)
    for gemm in (layer_gemm, head_gemm):
        prepared = gemm.prepare(w)
        torch.testing.assert_close(gemm.linear(x, prepared, b), expect, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gemm.linear_add(x, prepared, residual), expect - b + residual,
                                   rtol=1e-5, atol=1e-5)
