"""Structured output at the door: OpenAI's and vLLM's ways of asking map onto one spec, and what would not
compile (malformed, beyond xgrammar's dialect) or would compile too slowly is refused with a message that says
why. Pure Python: no xgrammar here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shared.grammar import (
    MAX_CHOICES,
    MAX_DEPTH,
    MAX_ENTRIES,
    MAX_SOURCE_BYTES,
    GrammarError,
    GrammarSpec,
    check,
    from_openai,
)
from tests.conftest import ROOT

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def _refused(match: str, **params: object) -> None:
    with pytest.raises(GrammarError, match=match):
        from_openai(**params)  # type: ignore[arg-type]


# --- mapping ---------------------------------------------------------------------------------------------------

def test_nothing_asked_is_free_text() -> None:
    assert from_openai(None) is None
    assert from_openai({"type": "text"}) is None


def test_openai_response_format_maps_onto_a_spec() -> None:
    assert from_openai({"type": "json_object"}) == GrammarSpec("json_object", "")
    spec = from_openai({"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert spec == GrammarSpec("json_schema", json.dumps(PERSON, separators=(",", ":")))


def test_the_schema_keeps_its_property_order() -> None:
    """The output lists properties in the schema's order (as OpenAI's does): the canonical text keeps it."""
    spec = from_openai(guided_json={"type": "object", "properties": {"b": {}, "a": {}}})
    assert spec is not None and spec.source.index('"b"') < spec.source.index('"a"')


def test_vllm_guided_fields_map_onto_a_spec() -> None:
    as_text = from_openai(guided_json=json.dumps(PERSON, indent=2))
    assert as_text == from_openai(guided_json=PERSON) == from_openai(structured_outputs={"json": PERSON})
    assert from_openai(guided_regex=r"\d{3}") == GrammarSpec("regex", r"\d{3}")
    assert from_openai(guided_choice=["yes", "no"]) == GrammarSpec("choice", '["yes","no"]')
    assert from_openai(guided_grammar='root ::= "a"') == GrammarSpec("grammar", 'root ::= "a"')
    assert from_openai(structured_outputs={"regex": "[a-z]+"}) == GrammarSpec("regex", "[a-z]+")
    assert from_openai(structured_outputs={"choice": ["x"]}) == GrammarSpec("choice", '["x"]')
    assert from_openai(structured_outputs={"grammar": 'root ::= "a"'}) == GrammarSpec("grammar", 'root ::= "a"')
    assert from_openai(structured_outputs={"json_object": True}) == GrammarSpec("json_object", "")
    assert from_openai(structured_outputs={"json": None, "disable_any_whitespace": True}) is None


def test_a_spec_is_known_by_its_hash() -> None:
    a, b = GrammarSpec("regex", "[a-z]+"), GrammarSpec("grammar", "[a-z]+")
    assert a.key == GrammarSpec("regex", "[a-z]+").key and a.key != b.key and len(a.key) == 64
    assert from_openai(guided_choice=["é", "✓"]).source == '["é","✓"]'  # type: ignore[union-attr]


def test_more_than_one_way_at_once_is_refused() -> None:
    _refused(r"give only one of .* \(got response_format, guided_regex\)",
             response_format={"type": "json_object"}, guided_regex="[0-9]+")
    _refused("give only one", guided_json=PERSON, guided_choice=["a"])
    _refused("give only one", structured_outputs={"regex": "a", "choice": ["a"]})
    assert from_openai({"type": "text"}, guided_regex="[0-9]+") is not None  # text asks for nothing


def test_malformed_requests_are_refused() -> None:
    _refused("response_format type 'xml' is not supported", response_format={"type": "xml"})
    _refused("response_format must be an object", response_format="json")
    _refused("needs json_schema.schema", response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    _refused("guided_json is not valid JSON", guided_json="{nope")
    _refused("must be a JSON schema", guided_json=[1, 2])
    _refused("guided_regex must be a string", guided_regex=5)
    _refused("guided_choice must be a list of strings", guided_choice=["a", 1])
    _refused("structural_tag is not supported", structured_outputs={"structural_tag": "{}"})
    with pytest.raises(GrammarError, match="unknown structured output kind"):
        check(GrammarSpec("xml", ""))


# --- JSON schemas --------------------------------------------------------------------------------------------

def test_good_schemas_pass() -> None:
    realistic = {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"}, "tags": {"type": "array", "items": {"type": "string"},
                                                               "maxItems": 10},
        "address": {"$ref": "#/$defs/address"}, "status": {"enum": ["active", "inactive"]},
        "not": {"type": "boolean"},  # a property may be called anything
    }, "required": ["name"], "$defs": {"address": {"type": "object", "properties": {
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "city": {"type": "string", "maxLength": 40}}}}}
    for schema in (realistic, PERSON, True, {}, {"type": ["string", "null"]}, {"const": {"not": 1}},
                   {"allOf": [PERSON]}, {"anyOf": [PERSON, {"type": "string"}]}):
        assert from_openai(guided_json=schema) is not None


def test_an_invalid_schema_is_refused() -> None:
    _refused(r'the JSON schema is invalid at type: "nonsense" is not valid here', guided_json={"type": "nonsense"})
    _refused("the JSON schema is invalid at properties/a/minimum", guided_json={"properties": {"a": {"minimum": "x"}}})
    _refused("allows no output", guided_json=False)


def test_an_oversized_schema_is_refused() -> None:
    big = {"type": "object", "description": "x" * MAX_SOURCE_BYTES}
    _refused(f"the JSON schema is {MAX_SOURCE_BYTES + 34} bytes; at most {MAX_SOURCE_BYTES}", guided_json=big)


def test_deep_nesting_is_refused() -> None:
    def nested(depth: int) -> dict[str, object]:
        schema: dict[str, object] = {"type": "string"}
        for _ in range(depth - 1):
            schema = {"type": "object", "properties": {"a": schema}}
        return schema

    assert from_openai(guided_json=nested(MAX_DEPTH)) is not None
    _refused(f"nests more than {MAX_DEPTH} levels deep", guided_json=nested(MAX_DEPTH + 1))
    _refused("nests too deep", guided_json="[" * 5000 + "]" * 5000)


def test_a_huge_enum_is_refused() -> None:
    assert from_openai(guided_json={"enum": list(range(MAX_ENTRIES))}) is not None
    _refused(f"has {MAX_ENTRIES + 1} enum/const values; at most {MAX_ENTRIES}",
             guided_json={"enum": list(range(MAX_ENTRIES + 1))})


def test_keywords_xgrammar_cannot_enforce_are_refused() -> None:
    for keyword, schema in [("'not'", {"type": "integer", "not": {"const": 3}}),
                            ("'if'/'then'/'else'", {"if": {"type": "string"}, "then": {"minLength": 2}}),
                            ("'uniqueItems'", {"type": "array", "uniqueItems": True}),
                            ("'contains'", {"type": "array", "contains": {"type": "integer"}}),
                            ("'dependentSchemas'", {"dependentSchemas": {"a": {"required": ["b"]}}})]:
        _refused(f"uses {keyword}.*cannot enforce", guided_json=schema)
    _refused(r"uses 'not' \(at properties.a\)", guided_json={"properties": {"a": {"not": {}}}})
    _refused("'allOf' with more than one schema", guided_json={"allOf": [PERSON, {"required": ["x"]}]})
    _refused("refers to 'https://example.com/s.json'", guided_json={"$ref": "https://example.com/s.json"})


def test_what_compiles_too_slowly_is_refused() -> None:
    """Bounded strings and repetitions of wide character sets are what xgrammar compiles slowest."""
    assert from_openai(guided_json={"type": "string", "maxLength": 50}) is not None
    _refused(r"too long to compile \(estimated .* s; at most 1.00 s\), mostly for: a string of maxLength 300",
             guided_json={"type": "string", "maxLength": 300})
    many = {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 20 + i} for i in range(20)}}
    _refused("too long to compile", guided_json=many)
    arrays = {"type": "object", "properties": {f"p{i}": {"type": "array", "maxItems": 200 + i} for i in range(3)}}
    _refused("an array of maxItems 20[012]", guided_json=arrays)
    _refused("long enum/const values", guided_json={"enum": ["x" * 1000 + str(i) for i in range(30)]})


# --- regexes -------------------------------------------------------------------------------------------------

def test_good_regexes_pass() -> None:
    for rx in (r"[0-9]{3}-[a-z]+", r"\w+@\w+\.com", r"(?:foo|bar)+", r"^abc$", r"a{1,1000}", r".*", r"[^\"]{0,60}",
               r"(\d{1,3}\.){3}\d{1,3}", "yes|no"):
        assert from_openai(guided_regex=rx) is not None, rx


def test_a_bad_regex_is_refused() -> None:
    _refused(r"the regex is invalid: missing \), unterminated subpattern", guided_regex="(ab")
    _refused("the regex is 2001 characters; at most 2000", guided_regex="a" * 2001)
    _refused("the regex repeats 1001 times; at most 1000", guided_regex="a{1001}")
    _refused('the JSON schema is invalid at properties/a/pattern: "\\[a-" must be a valid regex',
             guided_json={"properties": {"a": {"pattern": "[a-"}}})
    _refused("the pattern at properties.a is 2001 characters",
             guided_json={"properties": {"a": {"pattern": "a" * 2001}}})


def test_regex_features_outside_xgrammars_dialect_are_refused() -> None:
    for rx, what in [("a(?=b)", "lookahead"), ("(?<!a)b", "lookahead and lookbehind"), (r"(a)\1", "backreferences"),
                     (r"\bfoo\b", r"word boundaries \(\\b\)"), (r"\Aabc\Z", r"\\A"), ("(?i)abc", "sets flags"),
                     ("(?i:a)b", "sets flags"), ("(?P<x>a)", "names a group"), ("a*+", "possessive"),
                     ("(?>ab)", "atomic groups")]:
        _refused(f"the regex .*{what}", guided_regex=rx)
    _refused(r"the pattern at the root uses lookahead", guided_json={"type": "string", "pattern": "(?=a)a"})


def test_costly_regexes_are_refused() -> None:
    assert from_openai(guided_regex=".{1,60}") is not None
    _refused(r"too long to compile .* mostly for: \{1,200\} in the regex", guided_regex=".{1,200}")
    _refused("many bounded repetitions together",
             guided_regex="".join(f"[0-{i % 10}]{{1,128}}x" for i in range(30)))
    _refused("too long to compile", guided_regex="".join(f"[^{c}]{{1,20}}" for c in "abcdefghij"))


# --- choices and grammars ------------------------------------------------------------------------------------

def test_choices_are_bounded() -> None:
    assert from_openai(guided_choice=["a"] * MAX_CHOICES) is not None
    _refused(f"give 1 to {MAX_CHOICES} choices", guided_choice=[])
    _refused(f"give 1 to {MAX_CHOICES} choices", guided_choice=["a"] * (MAX_CHOICES + 1))
    _refused("each choice must be a non-empty string of at most 1000", guided_choice=["a", ""])
    _refused("each choice must be a non-empty string of at most 1000", guided_choice=["a" * 1001])
    _refused("too long to compile .* long choices", guided_choice=[f"{i:03d}" + "q" * 997 for i in range(30)])


def test_grammars_need_a_root_and_bounded_repetitions() -> None:
    assert from_openai(guided_grammar='root ::= item+\nitem ::= "(" [a-z]+ ")" | [0-9]{1,3}') is not None
    _refused("needs a rule named root", guided_grammar='start ::= "a"')
    _refused("repeats 5000 times", guided_grammar="root ::= [a-z]{1,5000}")
    _refused("repeats 5000 times", guided_grammar="root ::= [a-z]{,5000}")  # xgrammar's {,n}: 0 to n
    _refused("too long to compile", guided_grammar="root ::= [^a]{1,40} [^b]{1,40} [^c]{1,40}")


def test_checks_are_quick_and_remembered() -> None:
    spec = from_openai(guided_json={"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(300)}})
    assert spec is not None
    check(spec)  # again: remembered, not redone (the request is parsed at the door and again downstream)


def test_the_door_imports_no_xgrammar() -> None:
    out = subprocess.run([sys.executable, "-c", "import sys, shared.grammar; print('xgrammar' in sys.modules, "
                                                "'torch' in sys.modules)"], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
