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
