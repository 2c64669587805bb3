"""The engine's grammar side with the real tokenizer: masked logits only ever lead to output the grammar
accepts (a JSON schema, a regex, a choice), the matcher terminates on its stop token, bfloat16 logits mask as
float32 ones do, rows without a grammar are untouched, and a replayed state is the state it replays."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
import xgrammar as xgr
from tokenizers import Tokenizer

from gpu_worker.engine.grammar import GrammarState, mask_logits
from shared.grammar import GrammarSpec, compile_with, from_openai, tokenizer_info

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "note": {"type": "string"},
}, "required": ["name", "age", "ok", "tags", "note"]}
CHOICES = ["red", "green", "blue", "dark blue"]
EOS = 2  # <|im_end|>: the model's EOS, the grammars' stop token


@pytest.fixture(scope="module")
def tokenizer(model_path: str) -> Tokenizer:
    tok = Tokenizer.from_file(str(Path(model_path) / "tokenizer.json"))
    CLOSERS[:] = [EOS, *(tok.token_to_id(t) for t in ('"', "}", "]"))]
    return tok


@pytest.fixture(scope="module")
def compiler(model_path: str, tokenizer: Tokenizer) -> xgr.GrammarCompiler:
    return xgr.GrammarCompiler(tokenizer_info(model_path), max_threads=2)


def _compiled(compiler: xgr.GrammarCompiler, **params: object) -> xgr.CompiledGrammar:
    spec = from_openai(**params)  # type: ignore[arg-type]
    assert spec is not None
    return compile_with(compiler, spec)


CLOSERS: list[int] = []  # the stop token, '"', '}', ']' (the `tokenizer` fixture fills it in)


def _walk(state: GrammarState, seed: int, dtype: torch.dtype = torch.float32, steps: int = 400,
          stop_after: int = 24) -> list[int]:
    """Greedy decoding over random logits under the grammar's mask, until the matcher terminates. After
    `stop_after` steps the stop token and closing quotes and brackets are favoured (as a model would end), so
    unbounded grammars and free strings end too."""
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    for step in range(steps):
        logits = torch.randn(1, 49152, generator=gen).to(dtype)
        if step >= stop_after:
            logits[0, CLOSERS] += 50.0
        mask_logits(logits, [state])
        token = int(logits[0].float().argmax())
        assert torch.isfinite(logits[0, token]), "the mask left no token"
        assert state.accept(token), f"the grammar refused a token its own mask allowed: {token}"
        ids.append(token)
        if state.is_terminated():
            return ids
    raise AssertionError(f"not terminated after {steps} tokens: {ids}")


def _text(tokenizer: Tokenizer, ids: list[int]) -> str:
    assert ids[-1] == EOS  # the grammar ends on its stop token
    return tokenizer.decode(ids[:-1], skip_special_tokens=False)


def test_a_greedy_walk_under_a_json_schema_validates(compiler: xgr.GrammarCompiler, tokenizer: Tokenizer) -> None:
    compiled = _compiled(compiler, response_format={"type": "json_schema",
                                                    "json_schema": {"name": "person", "schema": SCHEMA}})
    for seed in range(3):
        text = _text(tokenizer, _walk(GrammarState(compiled), seed))
        value = json.loads(text)
        jsonschema.validate(value, SCHEMA)
        assert list(value) == list(SCHEMA["properties"])  # the schema's property order, as OpenAI keeps it


def test_a_greedy_walk_under_a_regex_fullmatches(compiler: xgr.GrammarCompiler, tokenizer: Tokenizer) -> None:
    compiled = _compiled(compiler, guided_regex=r"[0-9]{3}-[a-z]+")
    texts = {_text(tokenizer, _walk(GrammarState(compiled), seed)) for seed in range(3)}
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]+", t) for t in texts), texts


def test_a_greedy_walk_under_a_choice_is_one_of_them(compiler: xgr.GrammarCompiler, tokenizer: Tokenizer) -> None:
    compiled = _compiled(compiler, guided_choice=CHOICES)
    for seed in range(4):
        assert _text(tokenizer, _walk(GrammarState(compiled), seed, stop_after=0)) in CHOICES


def test_bfloat16_logits_are_masked_like_float32(compiler: xgr.GrammarCompiler, tokenizer: Tokenizer) -> None:
    compiled = _compiled(compiler, guided_json=SCHEMA)
    state = GrammarState(compiled)
    gen = torch.Generator().manual_seed(7)
    for _ in range(12):  # step by step along one walk: both dtypes bar the same tokens
        wide = torch.randn(1, 49152, generator=gen)
        narrow = wide.to(torch.bfloat16)
        mask_logits(wide, [state])
        mask_logits(narrow, [state])
        assert torch.equal(torch.isinf(wide), torch.isinf(narrow))
        kept = ~torch.isinf(wide)
        assert torch.equal(narrow[kept], wide[kept].to(torch.bfloat16))  # the allowed ones untouched
        assert state.accept(int(wide[0].argmax()))
    assert json.loads(_text(tokenizer, _walk(GrammarState(compiled), 3, dtype=torch.bfloat16))) is not None


def test_rows_without_a_grammar_are_untouched(compiler: xgr.GrammarCompiler) -> None:
    compiled = _compiled(compiler, guided_choice=CHOICES)
    states = [None, GrammarState(compiled), None, GrammarState(_compiled(compiler, guided_regex="[0-9]+"))]
    logits = torch.randn(4, 49152, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    mask_logits(logits, states)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    for row in (1, 3):  # a constrained row: barred tokens are -inf, the others keep their value
        allowed = torch.isfinite(logits[row])
        assert 0 < int(allowed.sum()) < 49152
        assert torch.equal(logits[row][allowed], before[row][allowed])
    assert not torch.isfinite(logits[[1, 3], :17]).any()  # special tokens (<|im_start|>, ...) are barred
    untouched = torch.randn(2, 49152)
    copy = untouched.clone()
    mask_logits(untouched, [None, None])
    assert torch.equal(untouched, copy)


def test_the_mask_is_xgrammars_own(compiler: xgr.GrammarCompiler) -> None:
    """The CPU path (torch ops) bars exactly what xgrammar's own kernel bars, for all rows or some."""
    compiled = _compiled(compiler, guided_json=SCHEMA)
    states: list[GrammarState | None] = []
    for seed in range(6):
        state = GrammarState(compiled)
        for token in _walk(GrammarState(compiled), seed)[:seed * 3]:
            state.accept(token)
        states.append(state)
    for chosen in (states, [s if i % 2 else None for i, s in enumerate(states)]):
        rows = [i for i, s in enumerate(chosen) if s is not None]
        bitmask = xgr.allocate_token_bitmask(len(chosen), 49152)
        for i in rows:
            chosen[i].fill(bitmask, i)  # type: ignore[union-attr]
        for dtype in (torch.float32, torch.bfloat16):
            ours = torch.randn(len(chosen), 49152).to(dtype)
            theirs = ours.clone()
            mask_logits(ours, chosen)
            xgr.apply_token_bitmask_inplace(theirs, bitmask, indices=rows, backend="cpu")
            assert torch.equal(ours, theirs)


def test_logits_wider_than_the_vocabulary_bar_the_extra_tokens(compiler: xgr.GrammarCompiler) -> None:
    compiled = _compiled(compiler, guided_regex="[a-z]+")
    logits = torch.zeros(3, 49152 + 64)
    mask_logits(logits, [GrammarState(compiled), None, GrammarState(compiled)])
    assert torch.isinf(logits[[0, 2], 49152:]).all()
    assert torch.equal(logits[1], torch.zeros(49152 + 64))


def test_replay_rebuilds_the_same_state(compiler: xgr.GrammarCompiler) -> None:
    compiled = _compiled(compiler, guided_json=SCHEMA)
    ids = _walk(GrammarState(compiled), 11)
    cut = len(ids) // 2
    original = GrammarState(compiled)
    for token in ids[:cut]:
        assert original.accept(token)
    resumed = GrammarState(compiled)
    resumed.replay(ids[:cut])
    a, b = torch.zeros(1, 49152), torch.zeros(1, 49152)
    mask_logits(a, [original])
    mask_logits(b, [resumed])
    assert torch.equal(a, b)
    for token in ids[cut:]:  # and it goes on to the same end
        assert resumed.accept(token)
    assert resumed.is_terminated()
    with pytest.raises(ValueError, match="does not fit the grammar"):
        GrammarState(compiled).replay([ids[0], ids[0], ids[0]])  # '{' '{' '{' is no JSON object


def test_a_terminated_state_allows_only_its_stop_tokens(compiler: xgr.GrammarCompiler) -> None:
    state = GrammarState(_compiled(compiler, guided_choice=["yes"]))
    _walk(state, 0, stop_after=0)
    assert state.is_terminated()
    logits = torch.zeros(2, 49152)
    mask_logits(logits, [GrammarState(_compiled(compiler, guided_choice=["yes"])), state])
    assert torch.nonzero(torch.isfinite(logits[1])).flatten().tolist() == [EOS]


def test_every_door_makes_the_same_spec() -> None:
    """guided_json as text, structured_outputs' json and response_format's json_schema are one spec (one
    compiled grammar, one Redis key)."""
    a = from_openai(guided_json=json.dumps(SCHEMA))
    b = from_openai(structured_outputs={"json": SCHEMA})
    c = from_openai(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
    assert a == b == c and isinstance(a, GrammarSpec)
