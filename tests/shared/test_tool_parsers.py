"""The Hermes tool call parser alone: whole texts, the same texts cut at every character, and generated calls
(hypothesis) read back exactly, however the text is cut into deltas."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.tool_parsers import ArgumentsDelta, CallStart, ContentDelta, Parsed, StreamEvent, ToolCall, parse, stream
from shared.tool_parsers.calls import collect

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}'
TEXTS = [
    "No tools needed: 2 < 3.",
    f"<tool_call>\n{WEATHER}\n</tool_call>",
    f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n"
    '{"arguments": {"q": "a \\"}</tool_call>\\" b"}, "name": "search"}\n</tool_call>',
    '<tool_call>{"name": "now"}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": 1',  # cut short by max_tokens
    "<tool_call>not a call</tool_call> so text",
    '<tool_call>{"arguments": {}}</tool_call>',  # no name: not a call
    '<tool_call>{"name": "f", "arguments": {"x": 1}}',  # no closing tag
    '<tool_call>{"name": "f", "parameters": {"x": true}}</tool_call> done',
    "ends on a partial tag <tool_",
    '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>\n{"na',  # cut before the 2nd's name
    'Hi.\n<tool_call>\n{"',
    'Let me look.\n<tool_call>{"name": "f"}</tool_call>\n\nWhile that runs: <tool_call>{"name": "g"}</tool_call>ok',
    '<tool_call>{"name": "f", "argu',  # cut short after the name, before the arguments
]


def _events(text: str, cuts: list[int]) -> list[StreamEvent]:
    parser, out, at = stream("hermes"), [], 0
    for cut in [*cuts, len(text)]:
        out += parser.feed(text[at:cut])
        at = cut
    return out + parser.finish()


def _merged(events: list[StreamEvent]) -> list[StreamEvent]:
    """Events with adjacent deltas of one kind joined: what a client makes of them."""
    out: list[StreamEvent] = []
    for e in events:
        last = out[-1] if out else None
        if isinstance(e, ContentDelta) and isinstance(last, ContentDelta):
            out[-1] = ContentDelta(last.text + e.text)
        elif isinstance(e, ArgumentsDelta) and isinstance(last, ArgumentsDelta) and last.index == e.index:
            out[-1] = ArgumentsDelta(e.index, last.fragment + e.fragment)
        else:
            out.append(e)
    return out


def test_whole_texts() -> None:
    assert parse("hermes", TEXTS[0]) == Parsed("No tools needed: 2 < 3.")
    assert parse("hermes", TEXTS[1]) == Parsed(None, [ToolCall("get_weather", '{"city": "Paris", "days": [1, 2]}')])
    two = parse("hermes", TEXTS[2])
    assert two.content == "Let me check."
    assert [c.name for c in two.calls] == ["get_weather", "search"]
    assert json.loads(two.calls[1].arguments) == {"q": 'a "}</tool_call>" b'}
    assert parse("hermes", TEXTS[3]) == Parsed(None, [ToolCall("now", "{}")])
    assert parse("hermes", TEXTS[4]) == Parsed(None, [ToolCall("f", '{"a": 1')])
    assert parse("hermes", TEXTS[5]) == Parsed("<tool_call>not a call</tool_call> so text")
    assert parse("hermes", TEXTS[6]) == Parsed('<tool_call>{"arguments": {}}</tool_call>')
    assert parse("hermes", TEXTS[7]) == Parsed(None, [ToolCall("f", '{"x": 1}')])
    assert parse("hermes", TEXTS[8]) == Parsed("done", [ToolCall("f", '{"x": true}')])
    assert parse("hermes", TEXTS[9]) == Parsed("ends on a partial tag <tool_")
    # a call the text stopped in before its name was whole is no call and no content: its markup is dropped
    assert parse("hermes", TEXTS[10]) == Parsed(None, [ToolCall("f", "{}")])
    assert parse("hermes", TEXTS[11]) == Parsed("Hi.")
    # text on both sides of a call stays apart: the whitespace after the call, else the whitespace before it
    assert parse("hermes", TEXTS[12]) == Parsed("Let me look.\n\nWhile that runs: ok",
                                                [ToolCall("f", "{}"), ToolCall("g", "{}")])
    # cut before its arguments began: no arguments, not the empty object of a call that takes none (an agent would
    # run that one; this one is incomplete)
    assert parse("hermes", TEXTS[13]) == Parsed(None, [ToolCall("f", "")])


@pytest.mark.parametrize("text", TEXTS)
def test_a_text_cut_anywhere_streams_the_same_events(text: str) -> None:
    whole = _merged(_events(text, []))
    for cut in range(1, len(text)):
        assert _merged(_events(text, [cut])) == whole, cut
    assert _merged(_events(text, list(range(1, len(text))))) == whole  # a character at a time


@pytest.mark.parametrize("text", TEXTS[1:4])
def test_markup_never_streams_as_content_and_the_name_comes_first(text: str) -> None:
    events = _events(text, list(range(1, len(text))))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    assert "<tool" not in content and "{" not in content
    for index in {e.index for e in events if isinstance(e, CallStart)}:
        kinds = [type(e) for e in events if not isinstance(e, ContentDelta) and e.index == index]
        assert kinds[0] is CallStart and set(kinds[1:]) == {ArgumentsDelta}


def test_an_unknown_parser_is_named() -> None:
    with pytest.raises(ValueError, match="unknown tool call parser 'mistral': one of hermes"):
        stream("mistral")


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=6),
                           lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)
calls = st.lists(st.tuples(st.text(min_size=1, max_size=8), st.dictionaries(st.text(max_size=5), json_values,
                                                                            max_size=3)), min_size=1, max_size=3)
spaces = st.sampled_from(["", "\n", " ", "\n\n"])


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=12).filter(lambda t: "<tool_call>" not in t), calls, spaces, st.booleans(),
       st.lists(st.integers(1, 400), max_size=12), st.data())
def test_generated_calls_read_back_exactly_however_cut(prefix: str, made: list[tuple[str, dict[str, Any]]],
                                                       gap: str, name_first: bool, cuts: list[int],
                                                       data: st.DataObject) -> None:
    blocks = []
    for name, args in made:
        ascii_only = data.draw(st.booleans())
        parts = [f'"name": {json.dumps(name)}', f'"arguments": {json.dumps(args, ensure_ascii=ascii_only)}']
        blocks.append(f"<tool_call>{gap}{{{', '.join(parts if name_first else parts[::-1])}}}{gap}</tool_call>")
    text = prefix + gap + gap.join(blocks)
    got = collect(_events(text, sorted({c for c in cuts if c < len(text)})))
    assert got.content == (prefix.rstrip() or None)
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == made
    assert got == parse("hermes", text)


def test_every_body_shows_the_answer_without_markup_cut_short() -> None:
    """A job that offered tools and whose text max_tokens cut inside a call: each API's body shows the text before
    it, as its stream did, and no markup; a job that offered none shows its text as written."""
    from api.anthropic import message_body
    from shared.jobs import Job
    from shared.openai_bodies import Shape, output_items

    rec = {"id": "job_1", "status": "succeeded", "model": "m", "finish_reason": "length", "created_at": "1.0",
           "text": 'Let me check.\n<tool_call>\n{"name": "get_wea', "tool_parser": "hermes"}
    job = Job.from_record(rec)
    chat = Shape(chat=True, logprobs=False, echo=False, prompts=[None]).choice(0, job)
    assert chat["message"] == {"role": "assistant", "content": "Let me check."}
    assert message_body(job)["content"] == [{"type": "text", "text": "Let me check."}]
    assert [c["text"] for item in output_items(job) for c in item["content"]] == ["Let me check."]
    plain = Job.from_record({**rec, "tool_parser": ""})
    assert Shape(chat=True, logprobs=False, echo=False, prompts=[None]).choice(0, plain)["message"]["content"] \
        == rec["text"]


def test_bodies_keep_the_texts_order_as_the_streams_do() -> None:
    """Text, a call, more text: Anthropic's blocks and the Responses items come in that order, whole as streamed
    (the Responses stream's items and ids: api/responses.py ToolEvents)."""
    from api.anthropic import message_body
    from api.responses import ToolEvents
    from shared.jobs import Job
    from shared.openai_bodies import output_items

    text = 'Let me look.\n<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\nWhile that runs: done.'
    job = Job.from_record({"id": "job_1", "status": "succeeded", "model": "m", "finish_reason": "stop",
                           "created_at": "1.0", "text": text, "tool_parser": "hermes"})
    blocks = message_body(job)["content"]
    assert [b["type"] for b in blocks] == ["text", "tool_use", "text"]
    assert blocks[0]["text"] == "Let me look." and blocks[2]["text"] == "\nWhile that runs: done."
    items = output_items(job)
    events = ToolEvents(job, {"tool_parser": "hermes"})
    streamed = [data["item"] for ev in ([*events.text(text), *events.end(job)]) for _, kind, data in [ev]
                if kind == "response.output_item.done"]
    assert [(i["type"], i["id"]) for i in items] == [(i["type"], i["id"]) for i in streamed]
    assert [i["type"] for i in items] == ["message", "function_call", "message"]
