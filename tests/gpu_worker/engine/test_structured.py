"""Structured output in the engine, through the whole compile -> store -> load path (the tokenizer pool's
compiler, Redis, the inference worker's loader): constrained greedy and sampled runs match their grammar, a
resumed sequence rebuilds its matcher from the recorded tokens and goes on identically, and rows without a
grammar beside constrained ones are untouched."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest
import redis
from tokenizers import Tokenizer

from gpu_worker.engine import EngineConfig, LLMEngine
from gpu_worker.grammar import GrammarLoader
from shared.grammar import GrammarSpec
from shared.model_config import vocab_size
from shared.schemas import Request
from tests.gpu_worker.engine.test_engine import QUESTIONS, prompt_ids
from tests.gpu_worker.engine.test_logprobs import drive, tokens
from workers.tokenizer.grammar import GrammarCompiler


@pytest.fixture(scope="module")
def engine(model_path: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_path, dtype="float32", max_num_seqs=8))


@pytest.fixture(scope="module")
def compiled(model_path: str, redis_url: str) -> Iterator[dict[str, object]]:
    """Specs compiled by the tokenizer pool's compiler, loaded back by the worker's loader."""
    client = redis.Redis.from_url(redis_url.rsplit("/", 1)[0] + "/14")
    compiler = GrammarCompiler(model_path, client, ttl_s=60)
    loader = GrammarLoader(model_path, client, vocab_size(model_path) or 0)
    specs = {"regex": GrammarSpec("regex", "[0-9]{3}-[a-z]{2,5}"),
             "json": GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {
                 "city": {"type": "string", "maxLength": 12}}, "required": ["city"], "additionalProperties": False},
                 sort_keys=True, separators=(",", ":"))),
             "choice": GrammarSpec("choice", json.dumps(["Paris", "London", "Rome"], separators=(",", ":")))}
    out: dict[str, object] = {}
    for name, spec in specs.items():
        compiler.prepare(spec)
        out[name] = (spec, loader.load(spec.key, spec))
    compiler.close()
    yield out


def _request(rid: str, prompt: list[int], kind: tuple[GrammarSpec, object] | None, **kw: object) -> Request:
    req = Request(rid, prompt, **kw)  # type: ignore[arg-type]
    if kind is not None:
        spec, grammar = kind
        req.grammar_kind, req.grammar, req.compiled_grammar = spec.kind, spec.source, grammar
    return req


def test_constrained_outputs_match_their_grammars_beside_a_free_row(engine: LLMEngine, compiled: dict[str, object],
                                                                   model_path: str) -> None:
    tok = Tokenizer.from_file(model_path + "/tokenizer.json")
    prompt = prompt_ids(model_path, QUESTIONS[0])
    free_alone = tokens(drive(engine, [_request("free0", prompt, None, max_tokens=12, temperature=0)])["free0"])
    reqs = [_request("free", prompt, None, max_tokens=12, temperature=0)]
    reqs += [_request(f"{name}-{seed}", prompt, compiled[name], max_tokens=40, temperature=1.0, seed=seed)
             for name in ("regex", "json", "choice") for seed in range(3)]
    outs = drive(engine, reqs)
    assert tokens(outs["free"]) == free_alone  # a row without a grammar is untouched by its neighbours'
    for rid, steps in outs.items():
        text = tok.decode(tokens(steps), skip_special_tokens=True)
        if rid.startswith("regex"):
            assert re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", text), text
        elif rid.startswith("json"):
            assert set(json.loads(text)) == {"city"}, text
        elif rid.startswith("choice"):
            assert text in ("Paris", "London", "Rome"), text
        if rid != "free":
            assert steps[-1].finish_reason == "stop", (rid, text)


def test_a_resumed_sequence_rebuilds_its_matcher_and_goes_on_identically(engine: LLMEngine,
                                                                         compiled: dict[str, object],
                                                                         model_path: str) -> None:
    prompt = prompt_ids(model_path, "Give me a city as JSON.")
    whole = tokens(drive(engine, [_request("w", prompt, compiled["json"], max_tokens=40, temperature=0.8,
                                           seed=7)])["w"])
    assert len(whole) > 4
    k = len(whole) // 2
    rest = tokens(drive(engine, [_request("r", prompt, compiled["json"], max_tokens=40, temperature=0.8, seed=7,
                                          resume_ids=whole[:k])])["r"])
    assert whole[:k] + rest == whole
