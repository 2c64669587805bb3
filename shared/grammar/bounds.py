"""`check`: the door's refusal of a spec that is malformed, that xgrammar cannot enforce, or whose compile is
estimated (cost.py) to take more than COMPILE_BUDGET_MS; each kind's checks live in their own module."""

from __future__ import annotations

from functools import lru_cache

from shared.grammar.choice import check_choices
from shared.grammar.cost import Cost
from shared.grammar.ebnf import check_ebnf
from shared.grammar.limits import MAX_SOURCE_BYTES, MAX_TOOLS_SOURCE_BYTES
from shared.grammar.regex import check_regex
from shared.grammar.schema import check_schema
from shared.grammar.spec import KINDS, GrammarError, GrammarSpec
from shared.grammar.tools import check_tool_calls

_NOUN = {"json_schema": "JSON schema", "json_object": "json_object grammar", "regex": "regex",
         "choice": "list of choices", "grammar": "grammar", "tool_calls": "tools"}


def check(spec: GrammarSpec) -> None:
    """Refuse (GrammarError) a spec that is malformed, that xgrammar cannot enforce, or whose compile is
    estimated to take more than COMPILE_BUDGET_MS. Each request is checked at the door and again where it is
    parsed downstream: a spec that passed is remembered."""
    _check(spec.kind, spec.source)


@lru_cache(maxsize=256)  # an exception is not cached: a refused spec is checked anew (and refused) each time
def _check(kind: str, source: str) -> None:
    if kind not in KINDS:
        raise GrammarError(f"unknown structured output kind {kind!r}: one of {', '.join(KINDS)}")
    size, limit = len(source.encode()), MAX_TOOLS_SOURCE_BYTES if kind == "tool_calls" else MAX_SOURCE_BYTES
    if size > limit:
        raise GrammarError(f"the {_NOUN[kind]} ({size} bytes without descriptions) exceed {limit} bytes"
                           if kind == "tool_calls" else f"the {_NOUN[kind]} is {size} bytes; at most {limit}")
    cost = Cost()
    if kind == "json_schema":
        check_schema(source, cost)
    elif kind == "json_object":
        if source:
            raise GrammarError("a json_object grammar has no source")
    elif kind == "regex":
        check_regex(source, cost, "the regex")
    elif kind == "choice":
        check_choices(source, cost)
    elif kind == "tool_calls":
        check_tool_calls(source, cost)
    else:
        check_ebnf(source, cost)
    cost.settle()
