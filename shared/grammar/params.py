"""The request parameters that ask for structured output, mapped onto one GrammarSpec: OpenAI's
`response_format`, vLLM's `guided_*` and its newer `structured_outputs`."""

from __future__ import annotations

from typing import Any

from shared.grammar.bounds import check
from shared.grammar.spec import GrammarError, GrammarSpec, canonical, loads


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
        value = loads(value, f"{name} is not valid JSON")
    if not isinstance(value, (dict, bool)):
        raise GrammarError(f"{name} must be a JSON schema (an object)")
    return GrammarSpec("json_schema", canonical(value))


def _text(value: Any, kind: str, name: str) -> GrammarSpec:
    if not isinstance(value, str):
        raise GrammarError(f"{name} must be a string")
    return GrammarSpec(kind, value)


def _choice(value: Any, name: str) -> GrammarSpec:
    if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
        raise GrammarError(f"{name} must be a list of strings")
    return GrammarSpec("choice", canonical(value))
