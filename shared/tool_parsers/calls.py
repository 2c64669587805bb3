"""What a tool call parser reads out of generated text: the calls whole (`Parsed`), or as a stream of events, in
the order OpenAI streams them (a call's index and name first, then its arguments' JSON text in fragments)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments' JSON text, as the model wrote it (a call cut short by max_tokens: a prefix)


@dataclass(frozen=True)
class Parsed:
    content: str | None  # the text outside the calls; None when there is none
    calls: list[ToolCall] = field(default_factory=list)
    # the text's pieces and the calls' indices in the order the text has them (a stream's blocks, in order)
    order: list[str | int] = field(default_factory=list, compare=False)


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    fragment: str


StreamEvent = ContentDelta | CallStart | ArgumentsDelta


def collect(events: list[StreamEvent]) -> Parsed:
    """The whole result a list of events adds up to."""
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    names = {e.index: e.name for e in events if isinstance(e, CallStart)}
    args = {i: "".join(e.fragment for e in events if isinstance(e, ArgumentsDelta) and e.index == i) for i in names}
    order: list[str | int] = []
    for e in events:
        if isinstance(e, ContentDelta):
            if order and isinstance(order[-1], str):
                order[-1] += e.text
            else:
                order.append(e.text)
        elif isinstance(e, CallStart):
            order.append(e.index)
    return Parsed(content or None, [ToolCall(names[i], args[i]) for i in sorted(names)], order)


def call_id(job_id: str, index: int, prefix: str = "call_") -> str:
    """A call's id, the same on every read of its job: OpenAI's `call_...` (Anthropic's `toolu_...`)."""
    return f"{prefix}{job_id.removeprefix('job_')}_{index}"


def openai_calls(job_id: str, calls: list[ToolCall]) -> list[dict[str, object]]:
    """Calls in OpenAI's `tool_calls` shape."""
    return [{"id": call_id(job_id, i), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for i, c in enumerate(calls)]
