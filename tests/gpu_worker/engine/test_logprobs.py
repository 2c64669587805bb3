"""Per-token features in the engine, checked against transformers over the same weights: logprobs of
generated and prompt tokens (the model's own log-softmax, float32, within 1e-4), the penalties, logit_bias
and min_tokens (greedy runs equal transformers' logits processors, or the formula where transformers has
none), and choices of one prompt sharing one prefill."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.engine import EngineConfig, LLMEngine
from gpu_worker.engine.block_manager import BlockManager
from gpu_worker.engine.step import StepOutput
from shared.schemas import Request
from tests.gpu_worker.engine.test_engine import QUESTIONS, prompt_ids, reference_model


def drive(engine: LLMEngine, reqs: list[Request]) -> dict[str, list[StepOutput]]:
    out: dict[str, list[StepOutput]] = {r.id: [] for r in reqs}
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished():
        for o in engine.step():
            assert o.error is None, o.error
            out.setdefault(o.id, []).append(o)
    return out


def tokens(outs: list[StepOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


# --- logprobs on the default model ----------------------------------------------------------------


@pytest.fixture(scope="module")
def real(model_path: str) -> tuple[LLMEngine, torch.nn.Module]:
    return LLMEngine(EngineConfig(model=model_path, dtype="float32", max_num_seqs=4)), reference_model(model_path)


def test_logprobs_and_prompt_logprobs_equal_transformers(real: tuple[LLMEngine, torch.nn.Module],
                                                         model_path: str) -> None:
    engine, hf = real
    prompt = prompt_ids(model_path, QUESTIONS[2])
    outs = drive(engine, [Request("lp", prompt, max_tokens=6, temperature=0, ignore_eos=True, logprobs=5,
                                  prompt_logprobs=3)])["lp"]
    gen = tokens(outs)
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([prompt + gen])).logits[0].float(), dim=-1)
    # generated: position len(prompt) - 1 + j predicts token j
    chosen = [lp for o in outs if o.logprobs for lp in o.logprobs.chosen]
    tops = [(i, v) for o in outs if o.logprobs for i, v in zip(o.logprobs.top_ids, o.logprobs.top_lps)]
    assert len(chosen) == len(gen) == 6
    for j, (token, lp, (top_ids, top_lps)) in enumerate(zip(gen, chosen, tops)):
        row = ref[len(prompt) - 1 + j]
        assert abs(lp - row[token].item()) < 1e-4
        want = torch.topk(row, 5)
        assert torch.allclose(torch.tensor(top_lps), want.values, atol=1e-4)
        assert top_ids[0] == token  # greedy: the chosen token is the most likely
    # the prompt's, from its second token on, once, with the first generated token
    first = next(o for o in outs if o.prompt_logprobs is not None)
    assert first.prompt_ids == prompt and sum(o.prompt_logprobs is not None for o in outs) == 1
    plp = first.prompt_logprobs
    assert len(plp) == len(prompt) - 1
    for k, (lp, top_lps) in enumerate(zip(plp.chosen, plp.top_lps)):
        row = ref[k]
        assert abs(lp - row[prompt[k + 1]].item()) < 1e-4
        assert torch.allclose(torch.tensor(top_lps), torch.topk(row, 3).values, atol=1e-4)


def test_prompt_logprobs_are_whole_when_the_prompt_is_cached_and_chunked(model_path: str) -> None:
    """Echo computes every prompt position (no prefix-cache hit), in chunks as small as the budget."""
    engine = LLMEngine(EngineConfig(model=model_path, dtype="float32", max_num_seqs=4, max_num_batched_tokens=16))
    prompt = prompt_ids(model_path, QUESTIONS[3])
    plain = drive(engine, [Request("warm", prompt, max_tokens=1, temperature=0)])  # caches the prompt's blocks
    assert tokens(plain["warm"])
    a = drive(engine, [Request("a", prompt, max_tokens=1, temperature=0, prompt_logprobs=0)])["a"]
    b = drive(engine, [Request("b", prompt, max_tokens=1, temperature=0, prompt_logprobs=0)])["b"]
    pa, pb = (next(o.prompt_logprobs for o in x if o.prompt_logprobs) for x in (a, b))
    assert len(pa) == len(pb) == len(prompt) - 1
    assert torch.allclose(torch.tensor(pa.chosen), torch.tensor(pb.chosen), atol=1e-5)


def test_prompt_logprobs_are_whole_after_a_preemption_in_the_prompt(tiny_model_dir: str) -> None:
    """A sequence preempted while its prompt is computed in chunks computes it again in other chunks (the budget
    depends on the rows decoding beside it): its echo still covers every prompt position, as alone."""
    def engine() -> LLMEngine:
        return LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", max_num_seqs=4, max_num_batched_tokens=32,
                                      max_model_len=256))

    def echo() -> Request:
        return Request("b", [100 + (i * 13) % 500 for i in range(100)], max_tokens=4, temperature=0, ignore_eos=True,
                       prompt_logprobs=1)

    alone = drive(engine(), [echo()])["b"]
    small = engine()
    small.blocks = small.scheduler.blocks = BlockManager(10, small.runner.block_size, True,
                                                         small.runner.generated_by_decode)  # 9 blocks of 16 tokens
    first = Request("a", [11 + i % 7 for i in range(30)], max_tokens=10, temperature=0, ignore_eos=True)
    small.add_request(first)
    small.step()  # "a" runs; "b" arrives and takes blocks until "a"'s decode needs one back
    out = drive(small, [echo()])["b"]
    assert small.scheduler.num_preemptions >= 1
    want, got = (next(o.prompt_logprobs for o in x if o.prompt_logprobs) for x in (alone, out))
    assert len(want) == len(got) == 99
    assert torch.allclose(torch.tensor(want.chosen), torch.tensor(got.chosen), atol=1e-5)
    assert tokens(out) == tokens(alone)


# --- penalties, bias, min_tokens: greedy runs of the default model ------------------------------------


@pytest.fixture(scope="module")
def tiny(real: tuple[LLMEngine, torch.nn.Module], model_path: str) -> tuple[LLMEngine, torch.nn.Module]:
    """The default model (a random one never repeats itself, so penalties would change nothing)."""
    global PROMPT
    PROMPT = prompt_ids(model_path, "Write the word hello five times, then the word bye five times.")
    return real


PROMPT: list[int] = []


def hf_greedy(hf: torch.nn.Module, n: int, **kw: object) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False, pad_token_id=2, **kw)
    return out[0, len(PROMPT):].tolist()


def test_repetition_penalty_equals_transformers(tiny: tuple[LLMEngine, torch.nn.Module]) -> None:
    engine, hf = tiny
    plain = tokens(drive(engine, [Request("plain", PROMPT, max_tokens=24, temperature=0, ignore_eos=True)])["plain"])
    got = tokens(drive(engine, [Request("r", PROMPT, max_tokens=24, temperature=0, ignore_eos=True,
                                        repetition_penalty=1.3)])["r"])
    assert got == hf_greedy(hf, 24, repetition_penalty=1.3)
    assert got != plain


def test_logit_bias_equals_transformers_sequence_bias(tiny: tuple[LLMEngine, torch.nn.Module]) -> None:
    engine, hf = tiny
    plain = tokens(drive(engine, [Request("p", PROMPT, max_tokens=12, temperature=0, ignore_eos=True)])["p"])
    bias = {plain[0]: -100.0, 1234: 5.0}
    got = tokens(drive(engine, [Request("b", PROMPT, max_tokens=12, temperature=0, ignore_eos=True,
                                        bias_ids=list(bias), bias_values=list(bias.values()))])["b"])
    assert got[0] != plain[0]
    assert got == hf_greedy(hf, 12, sequence_bias={(t,): v for t, v in bias.items()})


def test_min_tokens_equals_transformers(tiny: tuple[LLMEngine, torch.nn.Module]) -> None:
    """With the first greedy token made a stop token, it ends the output at once unless min_tokens bars it."""
    engine, hf = tiny
    first = tokens(drive(engine, [Request("f", PROMPT, max_tokens=1, temperature=0)])["f"])[0]
    short = drive(engine, [Request("s", PROMPT, max_tokens=10, temperature=0, stop_token_ids=[first])])["s"]
    assert tokens(short) == [first] and short[-1].finish_reason == "stop"
    got = tokens(drive(engine, [Request("m", PROMPT, max_tokens=10, temperature=0, stop_token_ids=[first],
                                        min_tokens=4)])["m"])
    assert len(got) >= 5 and first not in got[:4]
    from transformers import LogitsProcessorList, MinNewTokensLengthLogitsProcessor

    barred = [first, *engine.eos_token_ids]
    ref = hf_greedy(hf, len(got), logits_processor=LogitsProcessorList([MinNewTokensLengthLogitsProcessor(
        prompt_length_to_skip=len(PROMPT), min_new_tokens=4, eos_token_id=barred)]))
    assert got == ref[: len(got)]


def test_presence_and_frequency_penalties_follow_their_definition(tiny: tuple[LLMEngine, torch.nn.Module]) -> None:
    """transformers has no presence/frequency processors: each greedy step is checked against the formula
    (logit - frequency * count - presence * [count > 0], counts over the output only) on its own logits."""
    engine, hf = tiny
    got = tokens(drive(engine, [Request("pf", PROMPT, max_tokens=16, temperature=0, ignore_eos=True,
                                        presence_penalty=1.5, frequency_penalty=0.7)])["pf"])
    with torch.inference_mode():
        logits = hf(torch.tensor([PROMPT + got])).logits[0].float()
    for j, token in enumerate(got):
        row = logits[len(PROMPT) - 1 + j].clone()
        counts = torch.bincount(torch.tensor(got[:j], dtype=torch.long), minlength=row.shape[0]).float() if j else 0
        row -= 0.7 * counts + 1.5 * (counts > 0) if j else 0
        assert row.argmax().item() == token, j


def test_choices_of_one_prompt_share_one_prefill(tiny_model_dir: str) -> None:
    """Four choices of one 100-token prompt arriving together: one computes the prompt, the other three take
    its full blocks from the prefix cache (greedy: four identical answers)."""
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", max_num_seqs=8))
    prompt = [(i * 37) % 1000 + 3 for i in range(100)]
    bs = engine.blocks.block_size
    hits = engine.blocks.hits
    outs = drive(engine, [Request(f"c{i}", prompt, max_tokens=8, temperature=0, ignore_eos=True) for i in range(4)])
    answers = {tuple(tokens(o)) for o in outs.values()}
    assert len(answers) == 1
    assert engine.blocks.hits - hits == 3 * ((len(prompt) - 1) // bs) * bs
