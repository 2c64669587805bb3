"""The regex checks read CPython's private parser (`re._parser`). Where it is missing or has changed shape, a
regex is still checked, never a crash: valid, without flags or named groups, and costed from its source by a
rule that never estimates below the parsed form."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.grammar import GrammarError, GrammarSpec, check, from_openai
from shared.grammar import regex as grammar_regex
from shared.grammar.cost import Cost
from shared.grammar.regex import check_regex
from tests.conftest import ROOT

# a Python without re._parser: the door imported after it is gone, and asked about regexes
WITHOUT_PARSER = """
import json, re, sys
del re._parser
sys.modules["re._parser"] = None
from shared.grammar import GrammarError, GrammarSpec, check, from_openai
from shared.grammar.regex import PARSE

def outcome(**params):
    try:
        return from_openai(**params) is not None
    except GrammarError as exc:
        return str(exc)

print(json.dumps({"parse": PARSE is not None, "out": [outcome(guided_regex=rx) for rx in sys.argv[1:]],
                  "schema": outcome(guided_json={"type": "string", "pattern": "[a-z]{1,100}"})}))
"""


def _estimate(rx: str) -> tuple[float, str | None]:
    """The estimated ms of a spec made of this regex alone, and its refusal (None: accepted)."""
    cost = Cost()
    try:
        check_regex(rx, cost, "the regex")
        cost.settle()
    except GrammarError as exc:
        return cost.ms, str(exc)
    return cost.ms, None


def test_without_the_private_parser_regexes_are_checked_from_their_source() -> None:
    regexes = [r"[0-9]{3}-[a-z]+", ".{1,60}", ".{1,200}", "(ab", "(?i)abc", "(?P<x>a)", "a{1001}", "yes|no"]
    out = subprocess.run([sys.executable, "-c", WITHOUT_PARSER, *regexes], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    got = json.loads(out.stdout)
    assert got["parse"] is False
    out = dict(zip(regexes, got["out"]))
    assert out[r"[0-9]{3}-[a-z]+"] is out[".{1,60}"] is out["yes|no"] is True
    assert out["(ab"] == "the regex is invalid: missing ), unterminated subpattern at position 0"
    assert out["(?i)abc"] == "the regex sets flags (such as (?i)), which structured output does not support"
    assert out["(?P<x>a)"].startswith("the regex names a group ((?P<name>...))")
    assert out["a{1001}"] == "the regex repeats 1001 times; at most 1000"
    assert "too long to compile" in out[".{1,200}"] and "mostly for: {1,200} in the regex" in out[".{1,200}"]
    # conservative: [a-z] counts as wide, so a bound the parsed form admits (~0.25 s) is refused
    assert "too long to compile" in got["schema"] and "{1,100} in the pattern at the root" in got["schema"]
    assert from_openai(guided_json={"type": "string", "pattern": "[a-z]{1,100}"}) is not None


def test_a_parser_of_another_shape_falls_back_to_the_source(monkeypatch: pytest.MonkeyPatch) -> None:
    class Reshaped:  # what a future re._parser might hand back: items that are no longer (op, av) pairs
        state = None

        def __iter__(self) -> Any:
            return iter([("LITERAL", 97, 0)])

    monkeypatch.setattr(grammar_regex, "sre_parse", type("Parser", (), {"parse": staticmethod(lambda rx: Reshaped())}))
    assert grammar_regex._parser() is None  # the probe at import tells it apart
    monkeypatch.setattr(grammar_regex, "PARSE", lambda rx: Reshaped())  # and a surprise while walking, too
    assert _estimate("[0-9]{3}")[1] is None
    assert "mostly for: {1,300} in the regex" in str(_estimate("[0-9]{1,300}")[1])
    assert _estimate("(ab")[1] == "the regex is invalid: missing ), unterminated subpattern at position 0"


@settings(max_examples=300, deadline=None)
@given(rx=st.text(alphabet="ab()|*+?{}[]0-9,.\\^$-", max_size=30) | st.sampled_from(
    ["|".join(chr(0x100 + i) for i in range(130)), "(.{1,10}){1,10}", "[^a]{1,20}[^a]{1,20}", "\\D{1,50}|x{2,}"]))
def test_the_source_rule_never_estimates_below_the_parsed_form(rx: str) -> None:
    parsed_ms, parsed_refusal = _estimate(rx)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(grammar_regex, "PARSE", None)
        source_ms, source_refusal = _estimate(rx)
    if parsed_refusal is None or "too long to compile" in parsed_refusal:
        assert source_ms >= parsed_ms - 1e-9, rx
    if parsed_refusal is not None and "too long to compile" in parsed_refusal:
        assert source_refusal is not None and "too long to compile" in source_refusal, rx


@pytest.mark.parametrize("rx", ["a{99999999999}", "a{1,99999999999}"])
def test_a_count_past_the_parsers_integers_is_refused_not_raised(rx: str) -> None:
    """Python's parser raises OverflowError (not re.error) on such a count: it must still be a 422's GrammarError."""
    with pytest.raises(GrammarError, match="invalid"):
        check(GrammarSpec("regex", rx))
