"""Tool calls out of generated text: one parser per format, named as vLLM's `--tool-call-parser` names them
(TOOL_CALL_PARSER). Each reads a stream of text deltas (`stream()`: events as the text comes) and a whole text
(`parse`), and the two agree by construction: a whole text is parsed as one delta. The model's tool prompt (how
`tools` reach the prompt) and the grammar that holds a call to its schema live with the tokenizer and the grammar
engine; a parser only reads what came out."""

from __future__ import annotations

from shared.tool_parsers.calls import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    Parsed,
    StreamEvent,
    ToolCall,
    call_id,
    collect,
    openai_calls,
)
from shared.tool_parsers.hermes import HermesStream

__all__ = ["ArgumentsDelta", "CallStart", "ContentDelta", "Parsed", "StreamEvent", "ToolCall", "PARSERS", "call_id",
           "openai_calls", "parse", "stream"]

PARSERS = {"hermes": HermesStream}


def stream(name: str) -> HermesStream:
    """A new stream parser of the format TOOL_CALL_PARSER names; ValueError naming the formats there are."""
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}: one of {', '.join(sorted(PARSERS))}") from None


def parse(name: str, text: str) -> Parsed:
    """A whole generated text's content and tool calls, exactly as its stream would give them."""
    parser = stream(name)
    return collect([*parser.feed(text), *parser.finish()])
