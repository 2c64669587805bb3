"""A request can fail only itself inside the engine: bad ids, non-finite logits, a sampling or step
error end that request with an error while the rest of the batch runs on, token for token as if
the failing request had never been there. A tiny random model of the default's shape, real engine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from gpu_worker.engine import EngineConfig, LLMEngine
from gpu_worker.engine.sampler import Sampler
from gpu_worker.engine.sequence import Sequence
from shared.schemas import GenerationRequest, Request

POISON_TOKEN = 40_000
PROMPTS = [[1, 504, 3158, 314, 260, 1184, 30], [1, 2683, 253, 1345, 10425, 30], [1, 1978, 314, 260, 6568, 3930, 47]]


@pytest.fixture(scope="module")
def shared_engine(tiny_model_dir: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", max_num_seqs=8))


@pytest.fixture
def engine(shared_engine: LLMEngine) -> Iterator[LLMEngine]:
    """One engine for the module: each test leaves nothing in flight, and what it breaks (weights, the
    runner's step) is put back by monkeypatch, so the next test also checks that a failed request
    left nothing behind that changes another's tokens."""
    assert not shared_engine.has_unfinished()
    yield shared_engine
    assert not shared_engine.has_unfinished()


def drive(engine: LLMEngine, reqs: list[Request]) -> dict[str, tuple[list[int], str | None, str | None]]:
    """Run to completion: per request its tokens, finish reason and error."""
    out: dict[str, tuple[list[int], str | None, str | None]] = {}
    for r in reqs:
        engine.add_request(r)
    for _ in range(500):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            toks, _, _ = out.get(o.id, ([], None, None))
            out[o.id] = (toks + o.token_ids, o.finish_reason, o.error)
    assert not engine.has_unfinished()
    return out


def greedy(i: int, prompt: list[int], **kw: object) -> Request:
    return Request(f"r{i}", prompt, max_tokens=12, temperature=0, ignore_eos=True, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def alone(shared_engine: LLMEngine) -> list[list[int]]:
    return [drive(shared_engine, [greedy(i, p)])[f"r{i}"][0] for i, p in enumerate(PROMPTS)]


def _others_unharmed(out: dict, alone: list[list[int]]) -> None:  # type: ignore[type-arg]
    for i in range(len(PROMPTS)):
        tokens, reason, error = out[f"r{i}"]
        assert (tokens, reason, error) == (alone[i], "length", None)


def test_out_of_vocabulary_ids_fail_only_their_request(engine: LLMEngine, alone: list[list[int]]) -> None:
    """And so does a request past a bound the door guarantees (a record that reached the engine another way)."""
    vocab = engine.runner.vocab_size
    bad = [Request("bad-prompt", [1, vocab + 5], max_tokens=4),
           Request("bad-resume", [1, 2, 3], max_tokens=4, resume_ids=[-1]),
           Request("bad-bias", [1, 2, 3], max_tokens=4, bias_ids=[vocab], bias_values=[1.0]),
           Request("bad-top-p", [1, 2, 3], max_tokens=4, top_p=float("nan"), temperature=1.0),
           Request("too-hot", [1, 2, 3], max_tokens=4, temperature=50.0),
           Request("empty", [], max_tokens=4)]
    out = drive(engine, [*bad, *(greedy(i, p) for i, p in enumerate(PROMPTS))])
    for r in bad:
        tokens, reason, error = out[r.id]
        assert tokens == [] and reason == "error" and error
    _others_unharmed(out, alone)


def test_non_finite_logits_fail_only_their_row(engine: LLMEngine, alone: list[list[int]],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A token whose embedding is NaN (corrupt weights, an overflow) poisons only the sequences that
    hold it; their rows are caught before sampling."""
    embed = engine.runner.model.embed_w.clone()  # untie from the LM head: only inputs carrying the token are hit
    embed[POISON_TOKEN] = float("nan")
    monkeypatch.setattr(engine.runner.model, "embed_w", embed)
    poison = [Request("nan-greedy", [1, POISON_TOKEN, 30], max_tokens=8, temperature=0),
              Request("nan-sampled", [1, POISON_TOKEN, 31], max_tokens=8, temperature=0.7, top_p=0.9, seed=3)]
    out = drive(engine, [*poison, *(greedy(i, p) for i, p in enumerate(PROMPTS))])
    for r in poison:
        assert out[r.id][1] == "error" and "non-finite" in (out[r.id][2] or "")
    _others_unharmed(out, alone)


def test_tiny_temperature_is_greedy_in_the_engine(engine: LLMEngine, alone: list[list[int]]) -> None:
    """A temperature the door accepts but that would overflow the logits reaches the engine as greedy."""
    door = GenerationRequest(prompt="x", temperature=1e-40, max_tokens=12, ignore_eos=True)
    tiny = door.tokenized("tiny", PROMPTS[0])
    out = drive(engine, [greedy(0, PROMPTS[0]), tiny])
    assert out["tiny"] == (alone[0], "length", None)


def test_a_step_that_raises_for_one_request_fails_only_it(engine: LLMEngine, alone: list[list[int]],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The batched step raises; each sequence runs alone, and only the one that raises fails."""
    real_run = engine.runner.run

    def run(batch):  # type: ignore[no-untyped-def]
        if any(s.id == "boom" for s in batch.decode) or any(s.id == "boom" for s, _ in batch.chunks):
            raise RuntimeError("kernel failure for this request")
        return real_run(batch)

    monkeypatch.setattr(engine.runner, "run", run)
    out = drive(engine, [Request("boom", [1, 2, 3, 4], max_tokens=8), *(greedy(i, p) for i, p in enumerate(PROMPTS))])
    assert out["boom"][1] == "error" and "kernel failure" in (out["boom"][2] or "")
    _others_unharmed(out, alone)


def test_sampler_reports_bad_rows_instead_of_raising() -> None:
    logits = torch.randn(3, 50)
    logits[1, 7] = float("nan")
    logits[2, 0] = float("inf")
    seqs = [Sequence(Request(f"s{i}", [1], temperature=0.8, seed=i)) for i in range(3)]
    tokens, errors, _ = Sampler()(logits, seqs)
    assert set(errors) == {1, 2} and 0 <= tokens[0] < 50
