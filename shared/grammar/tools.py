"""Tool calls as structured output: OpenAI's `tools` and `tool_choice` made into one `tool_calls` spec, whose
grammar holds every call the model makes to a declared name and to that tool's parameter schema, in the Hermes
format the parser reads (shared/tool_parsers/hermes.py):

    <tool_call>
    {"name": "get_weather", "arguments": {...that tool's parameters...}}
    </tool_call>

- `auto`: free text; once the model writes `<tool_call>`, the call is held to a declared tool's schema (xgrammar's
  triggered tags), and free text may follow;
- `required`: one call or more, nothing else;
- a named function: exactly one call of that tool;
- `none`: no spec (and no tools in the prompt).

With a `response_format` (a JSON schema, or json_object) beside `auto`, the reply is either calls or the answer in
that form, nothing else (what OpenAI's API gives an agent that has tools and a structured output type).

`parallel_tool_calls: false` stops the output after the first call. The spec's source is canonical JSON of the
mode and the tools; `structural_tag` turns it into xgrammar's structural tag (built here as plain data: this
module does not import xgrammar)."""

from __future__ import annotations

import json
from typing import Any

from shared.grammar.cost import Cost
from shared.grammar.limits import MAX_SOURCE_BYTES
from shared.grammar.schema import check_schema
from shared.grammar.spec import GrammarError, GrammarSpec, canonical

MAX_TOOLS = 128
MAX_NAME = 64
START, END = "<tool_call>", "</tool_call>"
_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


ANSWER_KINDS = ("json_schema", "json_object")  # the structured outputs a final answer may be held to beside tools


def tools_spec(tools: list[Any] | None, choice: Any, parallel: bool = True,
               answer: GrammarSpec | None = None) -> GrammarSpec | None:
    """The spec OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` ask for; None when no call is wanted
    (no tools, or `none`). `answer`: the structured output (`response_format`) a reply other than calls must
    match (`auto` only: with `required` or a named function the reply is calls). GrammarError naming the parameter
    when they do not fit together."""
    if answer is not None and answer.kind not in ANSWER_KINDS:
        raise GrammarError("tools: with tools, the answer can be held to a JSON schema or json_object only "
                           "(not a regex, choice or grammar)")
    declared = _declared(tools or [])
    mode = _mode(choice, bool(declared))
    if mode is None:
        return None
    if isinstance(mode, tuple):  # a named function
        name = mode[1]
        if name not in declared:
            raise GrammarError(f"tool_choice names the function {name!r}, which is not among the tools")
        chosen, mode = {name: declared[name]}, "named"
    else:
        chosen = declared
    source: dict[str, Any] = {"mode": mode, "parallel": bool(parallel),
                              "tools": [{"name": n, "parameters": p} for n, p in chosen.items()]}
    if answer is not None and mode == "auto":
        source["answer"] = {"kind": answer.kind, "source": answer.source}
    return GrammarSpec("tool_calls", canonical(source))


def answer_of(source: str) -> GrammarSpec | None:
    """The structured output a tool_calls spec holds a reply other than calls to, if any."""
    answer = json.loads(source).get("answer")
    return GrammarSpec(answer["kind"], answer["source"]) if answer else None


def _declared(tools: list[Any]) -> dict[str, Any]:
    """Each function tool's name and parameter schema, in order; GrammarError naming the tool at fault."""
    if len(tools) > MAX_TOOLS:
        raise GrammarError(f"tools: {len(tools)} tools; at most {MAX_TOOLS}")
    out: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise GrammarError(f"{where}: only function tools are supported ({{\"type\": \"function\", ...}})")
        fn = tool.get("function", tool)  # Chat Completions nests it; Responses' function tools do not
        if not isinstance(fn, dict):
            raise GrammarError(f"{where}.function must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME or not set(name) <= _NAME_CHARS:
            raise GrammarError(f"{where}.function.name must be 1-{MAX_NAME} letters, digits, '_' or '-'")
        if name in out:
            raise GrammarError(f"{where}.function.name: {name!r} is declared twice")
        params = fn.get("parameters", _ANY_OBJECT)
        if not isinstance(params, dict):
            raise GrammarError(f"{where}.function.parameters must be a JSON schema object")
        if params.get("type", "object") != "object":
            raise GrammarError(f"{where}.function.parameters must describe the arguments as an object "
                               "(\"type\": \"object\", or no type)")
        # arguments are an object's text whatever else the schema says: `{}` (no parameters) or properties without
        # a type would otherwise let the grammar write `false` or a string, which no client can call with
        out[name] = {**_constraints(params), "type": "object"}
    return out


# keywords that say what a value means without constraining it: the prompt shows them (the tools as sent), the
# grammar has no use for them, and an agent's tools carry kilobytes of them
ANNOTATIONS = frozenset(("description", "title", "examples", "$comment", "deprecated", "readOnly", "writeOnly"))
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")


def _constraints(schema: Any) -> Any:
    """A JSON schema less its annotations (ANNOTATIONS), at every subschema; property names, enum and const values
    left as they are."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ANNOTATIONS and not isinstance(value, dict):
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: _constraints(v) for k, v in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [_constraints(v) for v in value]
        elif key in ("enum", "const", "default", "required"):
            out[key] = value
        else:
            out[key] = _constraints(value)  # items, additionalProperties, not, if/then/else, ... (a subschema)
    return out


def _mode(choice: Any, any_tools: bool) -> str | tuple[str, str] | None:
    if choice is None:
        choice = "auto" if any_tools else "none"
    if choice == "none" or (choice == "auto" and not any_tools):
        return None
    if choice in ("auto", "required"):
        if not any_tools:
            raise GrammarError("tool_choice 'required' needs tools")
        return str(choice)
    if isinstance(choice, dict):
        fn = choice.get("function", choice)  # {"type": "function", "function": {"name"}} or Responses' {"name"}
        if choice.get("type") == "function" and isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return ("named", fn["name"])
    raise GrammarError("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                       "\"function\": {\"name\": ...}}")


def check_tool_calls(source: str, cost: Cost) -> None:
    """A tool_calls spec's source is well formed and each tool's schema passes the JSON schema checks."""
    spec = json.loads(source)
    if not isinstance(spec, dict) or spec.get("mode") not in ("auto", "required", "named"):
        raise GrammarError("a tool_calls spec needs a mode: auto, required or named")
    tools = spec.get("tools")
    if not isinstance(tools, list) or not tools or len(tools) > MAX_TOOLS:
        raise GrammarError(f"a tool_calls spec needs 1-{MAX_TOOLS} tools")
    for i, tool in enumerate(tools):
        try:
            source = canonical(tool["parameters"])
            if len(source.encode()) > MAX_SOURCE_BYTES:
                raise GrammarError(f"{len(source.encode())} bytes without its descriptions; at most {MAX_SOURCE_BYTES}")
            check_schema(source, cost)
        except GrammarError as exc:
            raise GrammarError(f"tools[{i}].function.parameters: {exc}") from None
    answer = spec.get("answer")
    if answer is not None:
        if not isinstance(answer, dict) or answer.get("kind") not in ANSWER_KINDS or spec["mode"] != "auto":
            raise GrammarError(f"a tool_calls spec's answer is {' or '.join(ANSWER_KINDS)}, beside the auto mode")
        if answer["kind"] == "json_schema":
            check_schema(answer.get("source", ""), cost)


def structural_tag(source: str) -> dict[str, Any]:
    """xgrammar's structural tag for a tool_calls spec's source."""
    spec = json.loads(source)
    tags = [{"type": "tag", "begin": f'{START}\n{{"name": {json.dumps(t["name"], ensure_ascii=False)}, '
                                     f'"arguments": ',
             "content": {"type": "json_schema", "json_schema": t["parameters"]}, "end": f"}}\n{END}"}
            for t in spec["tools"]]
    once = not spec["parallel"]
    answer = spec.get("answer")
    if spec["mode"] == "auto" and answer:  # calls, or the answer in its structured form
        schema = json.loads(answer["source"]) if answer["kind"] == "json_schema" else {"type": "object"}
        fmt: dict[str, Any] = {"type": "or", "elements": [
            {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
             "stop_after_first": once},
            {"type": "json_schema", "json_schema": schema, "strict": answer["kind"] == "json_schema"}]}
    elif spec["mode"] == "auto":
        fmt = {"type": "triggered_tags", "triggers": [START], "tags": tags,
               "at_least_one": False, "stop_after_first": once}
    elif spec["mode"] == "required":
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
               "stop_after_first": once}
    else:
        fmt = tags[0]
    return {"type": "structural_tag", "format": fmt}
