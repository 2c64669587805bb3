"""Tool calls as structured output (shared/grammar/tools.py): what `tools` and `tool_choice` become, the refusals
that name the parameter at fault, and the compiled grammar holding a call to a declared tool's schema."""

from __future__ import annotations

import json
from typing import Any

import pytest

from shared.grammar import GrammarError, check, tools_spec
from shared.tool_parsers import parse

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
    "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "now"}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_what_each_choice_becomes() -> None:
    assert tools_spec(None, None) is None and tools_spec([], "auto") is None
    assert tools_spec([WEATHER], "none") is None
    auto = json.loads(tools_spec([WEATHER, NOW], None).source)  # tools given: auto by default, as OpenAI's
    assert auto == {"mode": "auto", "parallel": True, "tools": [
        {"name": "get_weather", "parameters": WEATHER["function"]["parameters"]},
        {"name": "now", "parameters": {"type": "object"}}]}
    named = json.loads(tools_spec([WEATHER, NOW], {"type": "function", "function": {"name": "now"}}, False).source)
    assert named == {"mode": "named", "parallel": False, "tools": [{"name": "now", "parameters": {"type": "object"}}]}
    responses_style = tools_spec([{"type": "function", "name": "now"}], {"type": "function", "name": "now"})
    assert json.loads(responses_style.source)["mode"] == "named"


@pytest.mark.parametrize(("tools", "choice", "message"), [
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "names the function 'nope', which is not"),
    ([], "required", "'required' needs tools"),
    ([WEATHER], "sometimes", "tool_choice must be"),
    ([{"type": "retrieval"}], "auto", r"tools\[0\]: only function tools"),
    ([{"type": "function", "function": {"name": "has space"}}], "auto", r"tools\[0\].function.name must be"),
    ([WEATHER, WEATHER], "auto", r"tools\[1\].function.name: 'get_weather' is declared twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "auto", "must be a JSON schema object"),
    ([NOW] * 129, "auto", "at most 128"),
])
def test_refusals_name_the_parameter(tools: list[Any], choice: Any, message: str) -> None:
    with pytest.raises(GrammarError, match=message):
        tools_spec(tools, choice)


def test_a_tool_schema_the_grammar_engine_cannot_enforce_is_refused_naming_the_tool() -> None:
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}
    spec = tools_spec([NOW, bad], "auto")
    with pytest.raises(GrammarError, match=r"tools\[1\].function.parameters: .*'not'"):
        check(spec)


@pytest.fixture(scope="module")
def compiled(model_path: str) -> Any:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from shared.grammar import compile_with, tokenizer_info

    info = tokenizer_info(model_path)
    compiler, tok = xgr.GrammarCompiler(info), AutoTokenizer.from_pretrained(model_path)

    def accepts(spec: Any, text: str) -> bool:
        """Whether the grammar takes the text's tokens and then lets the output end."""
        matcher = xgr.GrammarMatcher(compile_with(compiler, spec))
        ids = tok.encode(text, add_special_tokens=False)
        return all(matcher.accept_token(i) for i in ids) and (
            matcher.is_terminated() or matcher.accept_token(info.stop_token_ids[0]))
    return accepts


@pytest.mark.parametrize(("choice", "parallel", "taken"), [
    # text alone, a call, text then a call, two calls, a call breaking the schema
    ("auto", True, [True, True, True, True, False]),
    ("auto", False, [True, True, True, False, False]),
    ("required", True, [False, True, False, True, False]),
    ("required", False, [False, True, False, False, False]),
    ({"type": "function", "function": {"name": "get_weather"}}, True, [False, True, False, False, False]),
])
def test_the_grammar_holds_calls_to_their_schemas(compiled: Any, choice: Any, parallel: bool,
                                                  taken: list[bool]) -> None:
    spec = tools_spec([WEATHER, NOW], choice, parallel)
    check(spec)
    broken = CALL.replace('"city"', '"town"')
    texts = ["Hello there.", CALL, "Let me look. " + CALL, CALL + "\n" + CALL, broken]
    assert [compiled(spec, t) for t in texts] == taken
    assert parse("hermes", CALL).calls[0].name == "get_weather"  # what the grammar lets through, the parser reads


def _properties() -> Any:
    from hypothesis import strategies as st

    leaf = st.one_of(
        st.integers(1, 12).map(lambda n: {"type": "string", "maxLength": n}),
        st.lists(st.sampled_from(["red", "green", "blue", "Paris", "a b"]), min_size=1, max_size=4, unique=True)
        .map(lambda e: {"type": "string", "enum": e}),
        st.integers(0, 50).map(lambda lo: {"type": "integer", "minimum": lo, "maximum": lo + 100}),
        st.just({"type": "boolean"}),
        st.integers(1, 3).map(lambda n: {"type": "array", "items": {"type": "boolean"}, "maxItems": n}),
    )
    names = st.text("abcdefghij_", min_size=1, max_size=8)
    flat = st.dictionaries(names, leaf, min_size=1, max_size=3)
    return st.dictionaries(names, st.one_of(leaf, flat.map(_strict_object)), min_size=1, max_size=3)


def _strict_object(props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False}


@pytest.fixture(scope="module")
def sampler(model_path: str) -> Any:
    """Random generation under a compiled grammar: each step a token the grammar allows (half the time one that
    closes something, so that the output ends), until the grammar has ended; the token ids."""
    import numpy as np
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from shared.grammar import compile_with, tokenizer_info

    info = tokenizer_info(model_path)
    compiler, tok = xgr.GrammarCompiler(info), AutoTokenizer.from_pretrained(model_path)
    vocab = [tok.decode([i]) for i in range(info.vocab_size)]
    closing = np.array([any(c in t for c in '"}],') for t in vocab] + [False] * (info.vocab_size - len(vocab)))

    def run(spec: Any, seed: int, steps: int = 400) -> tuple[list[int], Any]:
        rng = np.random.default_rng(seed)
        matcher = xgr.GrammarMatcher(compile_with(compiler, spec))
        mask = xgr.allocate_token_bitmask(1, info.vocab_size)
        ids: list[int] = []
        for _ in range(steps):
            if matcher.is_terminated():
                break
            matcher.fill_next_token_bitmask(mask)
            allowed = _allowed(mask, info.vocab_size)
            pick = allowed[closing[allowed]] if rng.random() < 0.5 and closing[allowed].any() else allowed
            token = int(rng.choice(pick))
            assert matcher.accept_token(token)
            if token in info.stop_token_ids:
                break
            ids.append(token)
        assert matcher.is_terminated() or matcher.accept_token(info.stop_token_ids[0]), tok.decode(ids)
        return ids, tok
    return run


def _allowed(mask: Any, vocab: int) -> Any:
    """The token ids a bitmask (int32 words, bit set: allowed) allows."""
    import numpy as np
    import torch

    bits = mask[0].view(torch.uint8).numpy()
    return np.flatnonzero(np.unpackbits(bits, bitorder="little")[:vocab])


def test_a_required_call_always_parses_and_fits_its_schema(sampler: Any) -> None:
    """Over random tool schemas and random (grammar-held) outputs: the output is exactly one call to a declared
    tool whose arguments validate against that tool's schema, read the same whole and token by token."""
    import jsonschema
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from shared.tool_parsers import collect, stream

    @settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(props=_properties(), other=_properties(), seed=st.integers(0, 2**32 - 1))
    def check_one(props: dict[str, Any], other: dict[str, Any], seed: int) -> None:
        schemas = {"first": _strict_object(props), "second": _strict_object(other)}
        tools = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in schemas.items()]
        spec = tools_spec(tools, "required", parallel=False)
        check(spec)
        ids, tok = sampler(spec, seed)
        whole = parse("hermes", tok.decode(ids))
        assert whole.content is None and len(whole.calls) == 1
        call = whole.calls[0]
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        parser, seen, events = stream("hermes"), "", []
        for k in range(1, len(ids) + 1):
            text = tok.decode(ids[:k])
            if text.endswith("\ufffd"):
                continue  # a character still cut between tokens
            events += parser.feed(text[len(seen):])
            seen = text
        events += parser.feed(tok.decode(ids)[len(seen):]) + parser.finish()
        assert collect(events) == whole

    check_one()


@pytest.mark.parametrize("params", [{}, {"properties": {"city": {"type": "string"}}}])
def test_arguments_are_an_object_whatever_the_schema_leaves_open(sampler: Any, params: dict[str, Any]) -> None:
    """`parameters: {}` (a tool without parameters, as OpenAI reads it) or properties without a type: the arguments
    are still an object's text. The grammar used to let `false`, `true` or a string through, which no client can call
    with, and which the server then refused when the call was sent back."""
    spec = tools_spec([{"type": "function", "function": {"name": "f", "parameters": params}}], "required",
                      parallel=False)
    assert spec is not None
    for seed in range(8):
        ids, tok = sampler(spec, seed)
        [call] = parse("hermes", tok.decode(ids)).calls
        assert isinstance(json.loads(call.arguments), dict), call.arguments


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.mark.parametrize(("answer", "taken"), [
    # text alone, a call, two calls, the answer in its form, another object, the answer after text
    (("json_schema", PERSON), [False, True, True, True, False, False]),
    (("json_object", None), [False, True, True, True, True, False]),
])
def test_beside_a_response_format_the_reply_is_calls_or_the_answer_in_form(compiled: Any, answer: Any,
                                                                          taken: list[bool]) -> None:
    """Tools with a response_format (an agent with a structured output type): calls, or the final answer held to
    the format; with `required` or a named tool, calls only."""
    from shared.grammar import GrammarSpec

    kind, schema = answer
    given = GrammarSpec(kind, json.dumps(schema) if schema else "")
    spec = tools_spec([WEATHER, NOW], "auto", True, given)
    check(spec)
    texts = ["Hello there.", CALL, CALL + "\n" + CALL, '{"name": "Ann", "age": 7}', '{"x": 1}',
             'Sure. {"name": "Ann", "age": 7}']
    assert [compiled(spec, t) for t in texts] == taken
    assert json.loads(tools_spec([WEATHER], "required", True, given).source).get("answer") is None
    with pytest.raises(GrammarError, match="JSON schema or json_object only"):
        tools_spec([WEATHER], "auto", True, GrammarSpec("regex", "a+"))
