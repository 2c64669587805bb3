"""Structured output's one record (GrammarSpec), made from OpenAI's `response_format` or vLLM's `guided_*` /
`structured_outputs`, and the door's checks that every accepted grammar compiles quickly.

Pure Python: the API imports this module, and it never imports xgrammar or torch (`tokenizer_info` imports
them when the workers call it). The tokenizer pool compiles each grammar in a child process with a time
bound (workers/tokenizer/grammar.py), so a grammar these checks let through that still compiles slowly
fails its own job and nothing else; the checks are there so that this stays rare and the client is told
why at once.

What costs xgrammar time, measured on a 2-core CPU with the 49,152-token vocabulary (the compile builds,
for every state of the grammar, which tokens may come next):
- bounded repetitions of a wide character set: `.{1,100}` ~1.1 s, a JSON string with maxLength 256 ~2.4 s
  (`[a-z]{1,100}` ~0.17 s, `\\d{1,100}` ~0.02 s); the cost stops growing at ~150-256 repetitions, and
  distinct ones add up (20 strings of distinct maxLength near 50: 22 s);
- bounded arrays: ~(maxItems)^2 (10 arrays of maxItems ~128: 3.8 s);
- long literals among alternatives (enum, const, choices): ~(length)^2 (32 choices of 1,000 characters: 1.3 s);
- enums of very many entries (20,000: 13 s; 5,000: 0.07 s) and objects of very many properties (~3 ms each).
Unbounded repetitions (`.*`, `a+`), deep nesting, large counts of narrow sets (`a{1,100000}`), a few integer
ranges and `$ref` recursion are cheap; but many bounded states together cost more than their sum (30 distinct
`[0-9]`-like sets {1,128}: 32 s). So the checks add up an estimate of compile time (`_Cost`, in ms on
that machine, on the safe side) and refuse a spec over COMPILE_BUDGET_MS, naming what costs most.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from re import _constants as sre  # the parsed form of a regex: stable since Python 3.11
from re import _parser as sre_parse
from typing import Any

from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")

MAX_SOURCE_BYTES = 32 * 1024  # a schema, regex or grammar (UTF-8); far beyond any hand-written one
MAX_DEPTH = 24  # subschemas inside subschemas; also keeps the recursive checks well inside Python's stack
MAX_ENTRIES = 1024  # enum and const values in one schema (20,000 compile in 13 s; the cost grows faster than n)
MAX_REGEX_CHARS = 2000
MAX_REPEAT = 1000  # an explicit count in a regex or grammar ({m,n}); the cost estimate bounds wide ones further
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1000
# the estimated compile time a spec may need: specs at the edge of every kind of cost compiled in 0.9 s at most
# on that machine (~25 MB serialized), 5x inside the tokenizer pool's time bound
COMPILE_BUDGET_MS = 1000

# the cost model (estimated ms on a 2-core CPU, vocabulary 49,152), measured: see the module's docstring
_SATURATION = 256  # repetitions beyond this cost no more
_WIDE, _MEDIUM = 129, 17  # a set of at least this many characters is wide, medium (fewer: narrow)
_MS_PER_REPEAT = {"wide": 12.0, "medium": 2.5, "narrow": 0.5}
_MS_PER_WIDE_ATOM = 5.0  # a wide set outside any repetition (`...........`), when next to others
_MS_PER_STATE_SQ = 1.8e-3  # and the grammar's bounded states together: 10 distinct [0-9]-like {1,128} take 2.7 s
_MS_PER_ARRAY_BOUND_SQ = 1 / 40  # maxItems n costs ~min(n, 128)^2 / 40 ms
_ARRAY_SATURATION = 128
_LITERAL_SQ_PER_MS = 25_000  # alternatives' literals cost sum(len^2) / 25,000 ms
_MS_PER = {"property": 3.0, "branch": 2.0, "integer range": 10.0, "number range": 15.0, "format": 75.0,
           "multipleOf": 5.0, "base": 5.0}
_RANGE_STATES = {"integer range": 10, "number range": 15}  # a range's digits, as bounded states

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


class GrammarError(ValueError):
    """A structured-output request the service refuses, with a message for the client."""


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match: a kind (KINDS) and its canonical source text. The JSON schema keeps its
    properties' order (the output lists them in that order, as OpenAI's does); choices are a JSON list."""

    kind: str
    source: str

    @property
    def key(self) -> str:
        """Its identity (sha256 hex): the compiled grammar's Redis key and cache key."""
        return hashlib.sha256(f"{self.kind}\0{self.source}".encode()).hexdigest()


def from_openai(response_format: Any = None, guided_json: Any = None, guided_regex: str | None = None,
                guided_choice: list[Any] | None = None, guided_grammar: str | None = None,
                structured_outputs: dict[str, Any] | None = None) -> GrammarSpec | None:
    """The one spec that OpenAI's `response_format` or vLLM's `guided_*` / `structured_outputs` ask for (None:
    free text), checked (`check`). GrammarError when it is invalid, too costly, or more than one is given."""
    given: list[tuple[str, GrammarSpec]] = []
    if response_format is not None:
        spec = _response_format(_plain(response_format))
        if spec is not None:
            given.append(("response_format", spec))
    if guided_json is not None:
        given.append(("guided_json", _schema(guided_json, "guided_json")))
    if guided_regex is not None:
        given.append(("guided_regex", _text(guided_regex, "regex", "guided_regex")))
    if guided_choice is not None:
        given.append(("guided_choice", _choice(guided_choice, "guided_choice")))
    if guided_grammar is not None:
        given.append(("guided_grammar", _text(guided_grammar, "grammar", "guided_grammar")))
    if structured_outputs is not None:
        given += [(f"structured_outputs.{name}", spec) for name, spec in _structured_outputs(structured_outputs)]
    if len(given) > 1:
        raise GrammarError("give only one of response_format, guided_json, guided_regex, guided_choice, "
                           f"guided_grammar, structured_outputs (got {', '.join(name for name, _ in given)})")
    if not given:
        return None
    check(given[0][1])
    return given[0][1]


def _plain(value: Any) -> Any:
    """A pydantic model as its dict (the API may hand its parsed body's parts over as models)."""
    dump = getattr(value, "model_dump", None)
    return dump(exclude_none=True) if callable(dump) else value


def _response_format(rf: Any) -> GrammarSpec | None:
    if not isinstance(rf, dict):
        raise GrammarError("response_format must be an object with a 'type'")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", "")
    if kind == "json_schema":
        js = _plain(rf.get("json_schema"))
        if not isinstance(js, dict) or js.get("schema") is None:
            raise GrammarError("response_format of type json_schema needs json_schema.schema")
        return _schema(js["schema"], "response_format.json_schema.schema")
    raise GrammarError(f"response_format type {kind!r} is not supported: text, json_object or json_schema")


def _structured_outputs(so: Any) -> list[tuple[str, GrammarSpec]]:
    """vLLM's newer form: one of json, regex, choice, grammar, json_object (its other fields are options)."""
    so = _plain(so)
    if not isinstance(so, dict):
        raise GrammarError("structured_outputs must be an object")
    if so.get("structural_tag") is not None:
        raise GrammarError("structured_outputs.structural_tag is not supported")
    out: list[tuple[str, GrammarSpec]] = []
    if so.get("json") is not None:
        out.append(("json", _schema(so["json"], "structured_outputs.json")))
    if so.get("regex") is not None:
        out.append(("regex", _text(so["regex"], "regex", "structured_outputs.regex")))
    if so.get("choice") is not None:
        out.append(("choice", _choice(so["choice"], "structured_outputs.choice")))
    if so.get("grammar") is not None:
        out.append(("grammar", _text(so["grammar"], "grammar", "structured_outputs.grammar")))
    if so.get("json_object"):
        out.append(("json_object", GrammarSpec("json_object", "")))
    return out


def _schema(value: Any, name: str) -> GrammarSpec:
    value = _plain(value)
    if isinstance(value, str):
        value = _loads(value, f"{name} is not valid JSON")
    if not isinstance(value, (dict, bool)):
        raise GrammarError(f"{name} must be a JSON schema (an object)")
    return GrammarSpec("json_schema", _canonical(value))


def _text(value: Any, kind: str, name: str) -> GrammarSpec:
    if not isinstance(value, str):
        raise GrammarError(f"{name} must be a string")
    return GrammarSpec(kind, value)


def _choice(value: Any, name: str) -> GrammarSpec:
    if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
        raise GrammarError(f"{name} must be a list of strings")
    return GrammarSpec("choice", _canonical(value))


def _canonical(value: Any) -> str:
    """Compact JSON; key order kept (it is the output's property order), non-ASCII as is."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _loads(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except RecursionError:
        raise GrammarError(f"{what}: it nests too deep (at most {MAX_DEPTH} levels)") from None
    except ValueError as exc:
        raise GrammarError(f"{what}: {exc}") from None


def check(spec: GrammarSpec) -> None:
    """Refuse (GrammarError) a spec that is malformed, that xgrammar cannot enforce, or whose compile is
    estimated to take more than COMPILE_BUDGET_MS. Each request is checked at the door and again where it is
    parsed downstream: a spec that passed is remembered."""
    _check(spec.kind, spec.source)


@lru_cache(maxsize=256)  # an exception is not cached: a refused spec is checked anew (and refused) each time
def _check(kind: str, source: str) -> None:
    if kind not in KINDS:
        raise GrammarError(f"unknown structured output kind {kind!r}: one of {', '.join(KINDS)}")
    size = len(source.encode())
    if size > MAX_SOURCE_BYTES:
        raise GrammarError(f"the {_NOUN[kind]} is {size} bytes; at most {MAX_SOURCE_BYTES}")
    cost = _Cost()
    if kind == "json_schema":
        _check_schema(source, cost)
    elif kind == "json_object":
        if source:
            raise GrammarError("a json_object grammar has no source")
    elif kind == "regex":
        _check_regex(source, cost, "the regex")
    elif kind == "choice":
        _check_choices(source, cost)
    else:
        _check_ebnf(source, cost)
    cost.settle()


_NOUN = {"json_schema": "JSON schema", "json_object": "json_object grammar", "regex": "regex",
         "choice": "list of choices", "grammar": "grammar"}


class _Cost:
    """The estimated compile time of one spec, in ms, with what contributes most (for the message)."""

    def __init__(self) -> None:
        self.ms = _MS_PER["base"]
        self.parts: dict[str, float] = {}
        self.seen: set[Any] = set()  # identical constructs compile once (xgrammar shares them)
        self.states = 0  # bounded repetitions' states (each count up to _SATURATION), ranges' digits

    def add(self, ms: float, what: str, key: Any = None) -> None:
        if ms <= 0 or (key is not None and key in self.seen):
            return
        if key is not None:
            self.seen.add(key)
        self.ms += ms
        self.parts[what] = self.parts.get(what, 0.0) + ms

    def repeat(self, width: int, count: int, what: str, key: Any) -> None:
        """A set of `width` characters repeated up to `count` times: a state per count, and the set's own
        (45 distinct [^x]{2} take 1.6 s: the cost per repetition is higher for small counts)."""
        rate = _MS_PER_REPEAT["wide" if width >= _WIDE else "medium" if width >= _MEDIUM else "narrow"]
        if key is None or key not in self.seen:
            self.states += min(count, _SATURATION)
        self.add(rate * (min(count, _SATURATION) + 1), what, key)

    def settle(self) -> None:
        """Add the cost that grows with the square of the bounded states; refuse a spec over the budget."""
        self.add(_MS_PER_STATE_SQ * self.states * self.states, "many bounded repetitions together")
        if self.ms <= COMPILE_BUDGET_MS:
            return
        top = sorted(self.parts.items(), key=lambda kv: -kv[1])[:3]
        raise GrammarError(
            f"this would take too long to compile (estimated {self.ms / 1000:.2f} s; at most "
            f"{COMPILE_BUDGET_MS / 1000:.2f} s), mostly for: " + "; ".join(f"{w} (~{ms / 1000:.2f} s)" for w, ms in top)
            + ": loosen or drop these bounds (unbounded repetitions cost little)")


# --- JSON schema ---------------------------------------------------------------------------------------------

def _check_schema(source: str, cost: _Cost) -> None:
    schema = _loads(source, "the JSON schema is not valid JSON")
    if schema is False:
        raise GrammarError("the JSON schema `false` allows no output")
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("a JSON schema must be an object")
    counts = {"entries": 0}
    _walk_shape(schema, 1)  # depth first: the meta-schema check below recurses as deep
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise GrammarError(f"the JSON schema is invalid{f' at {where}' if where else ''}: {exc.message}") from None
    _walk_schema(schema, cost, counts, "")
    if counts["entries"] > MAX_ENTRIES:
        raise GrammarError(f"the JSON schema has {counts['entries']} enum/const values; at most {MAX_ENTRIES}")


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


def _walk_schema(node: Any, cost: _Cost, counts: dict[str, int], at: str) -> None:
    if not isinstance(node, dict):
        return
    where = f" (at {at})" if at else ""
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
    literals = node["enum"] if isinstance(node.get("enum"), list) else []
    if "const" in node:
        literals = [*literals, node["const"]]
    counts["entries"] += len(literals)
    for value in literals:
        n = len(json.dumps(value, ensure_ascii=False))
        cost.add(n * n / _LITERAL_SQ_PER_MS, "long enum/const values")
    _schema_costs(node, cost, at or "the root")
    if isinstance(node.get("patternProperties"), dict):
        for name in node["patternProperties"]:
            _check_regex(name, cost, f"the patternProperties key {name!r}")
    if isinstance(node.get("properties"), dict):
        cost.add(_MS_PER["property"] * len(node["properties"]), "properties")
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            cost.add(_MS_PER["branch"] * len(node[key]), f"{key} branches")
    for sub, path in _subschemas(node):
        _walk_schema(sub, cost, counts, f"{at}.{path}" if at else path)


def _schema_costs(node: dict[str, Any], cost: _Cost, at: str) -> None:
    """The costly constraints of one (sub)schema: string lengths and patterns, array bounds, ranges, formats."""
    lo, hi = node.get("minLength"), node.get("maxLength")
    if isinstance(hi, int) and hi > 1:  # a bounded string: each length a state over the whole string alphabet
        cost.repeat(_WIDE, hi, f"a string of maxLength {hi} at {at}", ("string", lo, hi))
    elif isinstance(lo, int) and lo > 1:  # at least lo characters: about half the cost of at most lo
        cost.add(_MS_PER_REPEAT["wide"] / 2 * min(lo, _SATURATION), f"a string of minLength {lo} at {at}",
                 ("string", lo, None))
    if isinstance(node.get("pattern"), str):
        _check_regex(node["pattern"], cost, f"the pattern at {at}")
    if isinstance(node.get("format"), str):
        cost.add(_MS_PER["format"], f"format {node['format']!r}", ("format", node["format"]))
    n = node.get("maxItems")
    if isinstance(n, int) and n > 1:
        bound = min(n, _ARRAY_SATURATION)
        key = ("array", _canonical(node.get("items")), node.get("minItems"), n)
        cost.add(bound * bound * _MS_PER_ARRAY_BOUND_SQ, f"an array of maxItems {n} at {at}", key)
    ranged = any(k in node for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"))
    if ranged:
        kind = "integer range" if node.get("type") == "integer" else "number range"
        cost.states += _RANGE_STATES[kind]
        cost.add(_MS_PER[kind], f"{kind}s")
    if "multipleOf" in node:
        cost.add(_MS_PER["multipleOf"], "multipleOf")


# --- regex ---------------------------------------------------------------------------------------------------

# what Python's `re` accepts and xgrammar's regex dialect does not (xgrammar would refuse it or, for \A and \Z,
# read a letter), found in the parsed pattern
_UNSUPPORTED_AT = {sre.AT_BOUNDARY: r"word boundaries (\b)", sre.AT_NON_BOUNDARY: r"word boundaries (\B)",
                   sre.AT_BEGINNING_STRING: r"\A (the whole output matches anyway)",
                   sre.AT_END_STRING: r"\Z (the whole output matches anyway)"}
_UNSUPPORTED_OPS = {sre.ASSERT: "lookahead and lookbehind", sre.ASSERT_NOT: "lookahead and lookbehind",
                    sre.GROUPREF: "backreferences", sre.GROUPREF_EXISTS: "conditional groups",
                    sre.ATOMIC_GROUP: "atomic groups (?>...)", sre.POSSESSIVE_REPEAT: "possessive repetitions"}
_CATEGORY_WIDTH = {sre.CATEGORY_DIGIT: 10, sre.CATEGORY_SPACE: 6, sre.CATEGORY_WORD: 63}
_REPEATS = (sre.MAX_REPEAT, sre.MIN_REPEAT)
_ALLOWED_FLAGS = re.UNICODE  # Python's default for a str pattern


def _check_regex(rx: str, cost: _Cost, what: str) -> None:
    """A regex must be short, valid (Python's `re` parses it, for a precise message), within xgrammar's dialect
    (no lookaround, backreferences, \\b, inline flags or named groups; note that xgrammar's `.` also matches a
    newline, and its \\d, \\w, \\s are ASCII), and not too costly to compile."""
    if len(rx) > MAX_REGEX_CHARS:
        raise GrammarError(f"{what} is {len(rx)} characters; at most {MAX_REGEX_CHARS}")
    try:
        parsed = sre_parse.parse(rx)
    except re.error as exc:
        raise GrammarError(f"{what} is invalid: {exc}") from None
    except RecursionError:
        raise GrammarError(f"{what} nests too deep") from None
    if parsed.state.flags & ~_ALLOWED_FLAGS:
        raise GrammarError(f"{what} sets flags (such as (?i)), which structured output does not support")
    if parsed.state.groupdict:
        raise GrammarError(f"{what} names a group ((?P<name>...)), which structured output does not support: "
                           "use (?:...) or (...)")
    try:
        _walk_regex(parsed, cost, what, False)
    except RecursionError:
        raise GrammarError(f"{what} nests too deep") from None


def _walk_regex(items: Any, cost: _Cost, what: str, repeated: bool) -> int:
    """Check a parsed pattern's items and add their cost (an atom inside a repetition is the repetition's); the
    width (characters) of its widest atom."""
    width = 0
    for op, av in items:
        if op in _UNSUPPORTED_OPS:
            raise GrammarError(f"{what} uses {_UNSUPPORTED_OPS[op]}, which structured output does not support")
        if op is sre.AT:
            if av in _UNSUPPORTED_AT:
                raise GrammarError(f"{what} uses {_UNSUPPORTED_AT[av]}, which structured output does not support")
            continue
        if op is sre.LITERAL:
            w = 1
        elif op in (sre.NOT_LITERAL, sre.ANY):
            w = _WIDE
        elif op is sre.IN:
            w = _set_width(av)
        elif op in _REPEATS:
            lo, hi, sub = av
            w = _walk_regex(sub, cost, what, True)
            count = lo if hi == sre.MAXREPEAT else hi
            if count > MAX_REPEAT:
                raise GrammarError(f"{what} repeats {count} times; at most {MAX_REPEAT}")
            if count > 1:
                cost.repeat(w, count, f"{{{lo},{'' if hi == sre.MAXREPEAT else hi}}} in {what}", (repr(sub), lo, hi))
        elif op is sre.SUBPATTERN:
            _, add_flags, del_flags, sub = av
            if add_flags or del_flags:
                raise GrammarError(f"{what} sets flags (such as (?i:...)), which structured output does not support")
            w = _walk_regex(sub, cost, what, repeated)
        elif op is sre.BRANCH:
            w = 0
            for alt in av[1]:
                w = max(w, _walk_regex(alt, cost, what, repeated))
                n = sum(1 for o, _ in alt if o is sre.LITERAL)
                cost.add(n * n / _LITERAL_SQ_PER_MS, f"long alternatives in {what}")
        else:
            w = _WIDE  # anything else Python parses: counted as wide, to be safe
        if w >= _WIDE and not repeated and op in (sre.NOT_LITERAL, sre.ANY, sre.IN):
            cost.add(_MS_PER_WIDE_ATOM, f"wide character sets in {what}")
        width = max(width, w)
    return width


def _set_width(items: Any) -> int:
    """How many characters a [...] set (or \\d, \\w, \\s) holds, roughly: a negated set counts as wide."""
    n = 0
    for op, av in items:
        if op is sre.NEGATE:
            return _WIDE
        if op is sre.LITERAL:
            n += 1
        elif op is sre.RANGE:
            n += av[1] - av[0] + 1
        elif op is sre.CATEGORY:
            n += _CATEGORY_WIDTH.get(av, _WIDE)
        else:
            n += _WIDE
    return n


# --- choices and EBNF grammars -------------------------------------------------------------------------------

def _check_choices(source: str, cost: _Cost) -> None:
    choices = _loads(source, "the choices are not a JSON list")
    if not isinstance(choices, list) or not 1 <= len(choices) <= MAX_CHOICES:
        raise GrammarError(f"give 1 to {MAX_CHOICES} choices")
    for c in choices:
        if not isinstance(c, str) or not 0 < len(c) <= MAX_CHOICE_CHARS:
            raise GrammarError(f"each choice must be a non-empty string of at most {MAX_CHOICE_CHARS} characters")
        cost.add(len(c) * len(c) / _LITERAL_SQ_PER_MS, "long choices")


_EBNF_ROOT = re.compile(r"^\s*root\s*::=", re.MULTILINE)
_EBNF_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def _check_ebnf(source: str, cost: _Cost) -> None:
    """An EBNF grammar (xgrammar's GBNF dialect) is parsed only by the compiler: here, that it has a root rule,
    and its bounded repetitions are counted as if over wide sets (the parse would tell, at a cost)."""
    if not _EBNF_ROOT.search(source):
        raise GrammarError("the grammar needs a rule named root (root ::= ...)")
    for m in _EBNF_REPEAT.finditer(source):
        lo, hi = int(m.group(1)), m.group(2)
        count = lo if not hi else int(hi)
        if count > MAX_REPEAT:
            raise GrammarError(f"the grammar repeats {count} times ({m.group(0)}); at most {MAX_REPEAT}")
        if count > 1:
            cost.repeat(_WIDE, count, f"{m.group(0)} in the grammar", None)


# --- for the workers (xgrammar is theirs) ---------------------------------------------------------------------

def compile_with(compiler: Any, spec: GrammarSpec) -> Any:
    """The spec compiled by an xgrammar GrammarCompiler (passed in: this module does not import xgrammar); the
    one place that says how each kind compiles, for the tokenizer pool and the inference worker's fallback alike.
    JSON comes out without free whitespace (a small model can otherwise spend its tokens on blank lines), with
    ", " and ": " as separators; a json_schema allows no properties it does not name (OpenAI's strict mode),
    a json_object any object."""
    if spec.kind == "json_schema":
        return compiler.compile_json_schema(spec.source, any_whitespace=False, strict_mode=True)
    if spec.kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if spec.kind == "regex":
        return compiler.compile_regex(spec.source)
    if spec.kind == "choice":  # EBNF string literals take JSON's escapes; non-ASCII stays as is (no surrogates)
        alternatives = (json.dumps(c, ensure_ascii=False) for c in json.loads(spec.source))
        return compiler.compile_grammar("root ::= " + " | ".join(alternatives))
    if spec.kind == "grammar":
        return compiler.compile_grammar(spec.source)
    raise GrammarError(f"unknown structured output kind {spec.kind!r}")


@lru_cache(maxsize=4)
def tokenizer_info(model_path: str, vocab_size: int | None = None) -> Any:
    """xgrammar's TokenizerInfo for the model, the same wherever a grammar is compiled or loaded (a compiled
    grammar's masks are only right for the vocabulary it was compiled with; loading checks just its size and
    stop tokens). `vocab_size` is the model's (its logits' width; config.json's when None). Special tokens
    (<|im_start|>, ...) are barred from constrained output: xgrammar would otherwise read them as their text,
    which the detokenizer drops. The stop tokens are the model's EOS ids (config.json, generation_config.json).

    Built once per process (~1.3 s; it does not change). Imports xgrammar and transformers (and so torch): only
    the workers call it, never the API."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    config = _json_file(model_path, "config.json")
    if vocab_size is None:
        vocab_size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    stop = _eos_ids(config, _json_file(model_path, "generation_config.json"))
    if not stop and tokenizer.eos_token_id is not None:
        stop = [int(tokenizer.eos_token_id)]
    detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop or None)
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if getattr(t, "special", False)}
    size = detected.vocab_size
    vocab = [""] * size  # an empty entry is a token xgrammar never allows (besides the stop tokens)
    for text, i in tokenizer.get_vocab().items():
        if i < size and i not in special:
            vocab[i] = text
    return xgr.TokenizerInfo(vocab, detected.vocab_type, vocab_size=size, stop_token_ids=detected.stop_token_ids,
                             add_prefix_space=detected.add_prefix_space)


def _json_file(model_path: str, name: str) -> dict[str, Any]:
    try:
        with open(f"{model_path}/{name}") as f:
            value = json.load(f)
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


def _eos_ids(*configs: dict[str, Any]) -> list[int]:
    """The EOS ids the model's configs name (as the engine reads them: gpu_worker/engine/model_runner.py)."""
    ids: set[int] = set()
    for cfg in configs:
        eos = cfg.get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(e) for e in eos)
    return sorted(ids)
