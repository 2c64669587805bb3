"""The door's checks on a JSON schema: well formed (the JSON Schema meta-schema), nested at most MAX_DEPTH deep,
within what xgrammar enforces, and its costly constraints added to the estimate (cost.py).

The meta-schema check is draft 7's, compiled to Python by fastjsonschema: jsonschema's own check of a schema took
~0.6 ms a node (2020-12's, with its dynamic references; draft 7's ~6 ms a schema), on the API's event loop, so 128
tools of deep schemas held every other request for seconds. Keywords draft 7 does not know (2020-12's `prefixItems`,
`$defs`) are let through by it and checked by the walks below."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

import fastjsonschema
from jsonschema import Draft7Validator

from shared.grammar.cost import WIDE, Cost
from shared.grammar.limits import MAX_DEPTH, MAX_ENTRIES
from shared.grammar.regex import check_regex
from shared.grammar.spec import GrammarError, canonical, loads

# schema keywords xgrammar does not enforce (it ignores them, or, for `contains`, allows only an empty array):
# refused, rather than returning output that fails the client's own validation
_UNENFORCED = {
    "not": "'not'", "if": "'if'/'then'/'else'", "then": "'if'/'then'/'else'", "else": "'if'/'then'/'else'",
    "contains": "'contains'", "minContains": "'minContains'", "maxContains": "'maxContains'",
    "uniqueItems": "'uniqueItems'", "dependentSchemas": "'dependentSchemas'", "dependencies": "'dependencies'",
    "$dynamicRef": "'$dynamicRef'", "$recursiveRef": "'$recursiveRef'",
}
# where a schema holds subschemas: maps of them, lists of them, one of them
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties", "unevaluatedItems",
               "propertyNames")


def check_schema(source: str, cost: Cost) -> None:
    """Refuse (GrammarError) a JSON schema's source that is malformed, too deep, unenforceable or holds too many
    enum/const values; add its costs to `cost`."""
    schema = loads(source, "the JSON schema is not valid JSON")
    if schema is False:
        raise GrammarError("the JSON schema `false` allows no output")
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("a JSON schema must be an object")
    counts = {"entries": 0}
    _walk_shape(schema, 1)  # depth first: the meta-schema check below recurses as deep
    try:
        _meta_schema()(schema)
    except fastjsonschema.JsonSchemaValueException as exc:
        where = "/".join(exc.path[1:])  # (its path starts at "data", the schema itself)
        why = "is not valid here" if exc.rule in ("anyOf", "oneOf") else exc.message.removeprefix(f"{exc.name} ")
        raise GrammarError(f"the JSON schema is invalid{f' at {where}' if where else ''}: "
                           f"{json.dumps(exc.value)[:80]} {why}") from None
    _walk_schema(schema, cost, counts, "")
    if counts["entries"] > MAX_ENTRIES:
        raise GrammarError(f"the JSON schema has {counts['entries']} enum/const values; at most {MAX_ENTRIES}")


@functools.cache
def _meta_schema() -> Callable[[Any], Any]:
    """The meta-schema's check, compiled once a process (~60 ms); it leaves the schema as it was (no defaults)."""
    return fastjsonschema.compile(Draft7Validator.META_SCHEMA, use_default=False)


def _walk_shape(node: Any, depth: int) -> None:
    """Refuse a schema whose subschemas nest deeper than MAX_DEPTH (maps of subschemas are not a level)."""
    if depth > MAX_DEPTH:
        raise GrammarError(f"the JSON schema nests more than {MAX_DEPTH} levels deep")
    for sub, _ in _subschemas(node):
        _walk_shape(sub, depth + 1)


def _subschemas(node: Any) -> list[tuple[Any, str]]:
    """A schema's direct subschemas, each with where it sits (for messages)."""
    if not isinstance(node, dict):
        return []
    out: list[tuple[Any, str]] = []
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            out += [(v, f"{key}.{k}") for k, v in node[key].items()]
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            out += [(v, f"{key}[{i}]") for i, v in enumerate(node[key])]
    for key in _SCHEMA_ONE:
        value = node.get(key)
        if isinstance(value, list):  # items as a tuple (drafts before 2020-12)
            out += [(v, f"{key}[{i}]") for i, v in enumerate(value)]
        elif isinstance(value, (dict, bool)):
            out.append((value, key))
    return out


def _walk_schema(node: Any, cost: Cost, counts: dict[str, int], at: str) -> None:
    if not isinstance(node, dict):
        return
    _refuse_unenforced(node, f" (at {at})" if at else "")
    literals = node["enum"] if isinstance(node.get("enum"), list) else []
    if "const" in node:
        literals = [*literals, node["const"]]
    counts["entries"] += len(literals)
    for value in literals:
        cost.literal(len(json.dumps(value, ensure_ascii=False)), "long enum/const values")
    _schema_costs(node, cost, at or "the root")
    if isinstance(node.get("patternProperties"), dict):
        for name in node["patternProperties"]:
            check_regex(name, cost, f"the patternProperties key {name!r}")
    if isinstance(node.get("properties"), dict):
        cost.each("property", len(node["properties"]), "properties")
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            cost.each("branch", len(node[key]), f"{key} branches")
    for sub, path in _subschemas(node):
        _walk_schema(sub, cost, counts, f"{at}.{path}" if at else path)


def _refuse_unenforced(node: dict[str, Any], where: str) -> None:
    """Refuse what xgrammar would not enforce in one (sub)schema: its keywords, outside references, allOf."""
    for key, value in node.items():
        if key in _UNENFORCED and value is not False:  # uniqueItems: false asks for nothing
            raise GrammarError(f"the JSON schema uses {_UNENFORCED[key]}{where}, which structured output cannot "
                               "enforce")
    ref = node.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        raise GrammarError(f"the JSON schema refers to {ref!r}{where}: only references inside the schema "
                           "('#/...') are supported")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        raise GrammarError(f"the JSON schema uses 'allOf' with more than one schema{where}, which structured "
                           "output cannot enforce: merge them into one")


def _schema_costs(node: dict[str, Any], cost: Cost, at: str) -> None:
    """The costly constraints of one (sub)schema: string lengths and patterns, array bounds, ranges, formats."""
    lo, hi = node.get("minLength"), node.get("maxLength")
    if isinstance(hi, int) and hi > 1:  # a bounded string: each length a state over the whole string alphabet
        cost.repeat(WIDE, hi, f"a string of maxLength {hi} at {at}", ("string", lo, hi))
    elif isinstance(lo, int) and lo > 1:  # at least lo characters
        cost.at_least(lo, f"a string of minLength {lo} at {at}", ("string", lo, None))
    if isinstance(node.get("pattern"), str):
        check_regex(node["pattern"], cost, f"the pattern at {at}")
    if isinstance(node.get("format"), str):
        cost.each("format", 1, f"format {node['format']!r}", ("format", node["format"]))
    n = node.get("maxItems")
    if isinstance(n, int) and n > 1:
        key = ("array", canonical(node.get("items")), node.get("minItems"), n)
        cost.array(n, f"an array of maxItems {n} at {at}", key)
    if any(k in node for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
        cost.range("integer range" if node.get("type") == "integer" else "number range")
    if "multipleOf" in node:
        cost.each("multipleOf", 1, "multipleOf")
