"""The compile-time estimate behind the door's refusals: identical constructs are counted once (xgrammar
shares them), and a refusal names what costs most, most costly first."""

from __future__ import annotations

import json
import re

import pytest

from shared.grammar import GrammarError, GrammarSpec, check, from_openai


def _refusal(spec: GrammarSpec) -> str:
    with pytest.raises(GrammarError) as exc:
        check(spec)
    return str(exc.value)


def test_identical_bounded_strings_cost_once() -> None:
    same = {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 50} for i in range(20)}}
    assert from_openai(guided_json=same) is not None
    distinct = {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 50 + i} for i in range(20)}}
    assert "too long to compile" in _refusal(GrammarSpec("json_schema", json.dumps(distinct)))


def test_a_refusal_names_the_three_costliest_parts_in_order() -> None:
    message = _refusal(GrammarSpec("regex", ".{1,200}[a-z]{1,300}x{1,3}"))
    assert re.fullmatch(r"this would take too long to compile \(estimated 3\.44 s; at most 1\.00 s\), mostly for: "
                        r"\{1,200\} in the regex \(~2\.41 s\); \{1,300\} in the regex \(~0\.64 s\); many bounded "
                        r"repetitions together \(~0\.38 s\): loosen or drop these bounds \(unbounded repetitions "
                        r"cost little\)", message), message


def test_each_kind_refuses_a_malformed_source() -> None:
    assert _refusal(GrammarSpec("json_object", "{}")) == "a json_object grammar has no source"
    assert _refusal(GrammarSpec("choice", "[")).startswith("the choices are not a JSON list: ")
    assert _refusal(GrammarSpec("json_schema", "3")) == "a JSON schema must be an object"
    assert from_openai(guided_json={"type": "array", "uniqueItems": False}) is not None  # asks for nothing
