"""The Hermes tool call format (vLLM's `hermes` parser; Qwen, Hermes and most templates that render `tools`):

    Some text.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A call is a JSON object with a string `name` and an `arguments` value (`parameters` is read the same way), between
`<tool_call>` and `</tool_call>`; a closing tag left out ends the call at its object's end. The content is the text
outside the calls, less the whitespace just before a call and just after one (text on both sides of a call keeps
one of the two as its separator). A block that is not such a call (no
name, not an object) is content, markup and all; one the text stops in before its name is whole (max_tokens) is
dropped: it is neither a call nor the model's prose.

The stream holds back what might still become markup (a partial `<tool_call>`, whitespace that may precede one),
so that raw markup never reaches a client as content, and it emits a call's name once the name is whole and its
arguments' JSON text as it grows. Its events do not depend on how the text is cut into deltas."""

from __future__ import annotations

import json
from dataclasses import dataclass

from shared.tool_parsers.calls import ArgumentsDelta, CallStart, ContentDelta, StreamEvent

START, END = "<tool_call>", "</tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class Scan:
    """What a call's body (the text after `<tool_call>`) shows so far."""
    malformed: int | None = None  # the index of the first character that cannot begin a call's object
    name: str | None = None
    args: tuple[int, int | None] | None = None  # the arguments value's span (end None: still open)
    end: int | None = None  # the index just past the object's closing brace


def scan(body: str) -> Scan:
    """Walk a call's JSON object: its top-level keys, the `name` string, the arguments value's span."""
    out = Scan()
    depth, in_str, esc = 0, False, False
    key_at = value_at = -1
    key: str | None = None
    expect = "open"  # open -> key -> colon -> value -> comma (-> key ...)
    for i, c in enumerate(body):
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
                if depth == 1 and expect == "key-string":
                    key, expect = _string(body[key_at:i + 1]), "colon"
                elif depth == 1 and expect == "in-value":
                    _value_ended(out, key, body, value_at, i + 1)
                    expect = "comma"
            continue
        if c.isspace():
            continue
        if expect == "open":
            if c != "{":
                out.malformed = i
                return out
            depth, expect = 1, "key"
            continue
        if depth == 1 and expect == "value":
            value_at, expect = i, "in-value"
            if key in ARGUMENT_KEYS:
                out.args = (i, None)
        if c == '"':
            in_str = True
            if depth == 1 and expect == "key":
                key_at, expect = i, "key-string"
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 1 and expect == "in-value":  # a nested value closed
                _value_ended(out, key, body, value_at, i + 1)
                expect = "comma"
            elif depth <= 0:
                if expect == "in-value":  # a scalar ended by the object's close
                    _value_ended(out, key, body, value_at, i)
                out.end = i + 1
                return out
        elif depth == 1 and c == ":" and expect == "colon":
            expect = "value"
        elif depth == 1 and c == ",":
            if expect == "in-value":  # a scalar (number, true, ...) ended
                _value_ended(out, key, body, value_at, i)
            expect = "key"
    return out


def _string(raw: str) -> str | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _value_ended(out: Scan, key: str | None, body: str, start: int, end: int) -> None:
    if key == "name" and out.name is None:
        out.name = _string(body[start:end].rstrip())
    elif key in ARGUMENT_KEYS and out.args is not None and out.args[1] is None:
        out.args = (start, len(body[:end].rstrip()))


class HermesStream:
    """Text deltas in, events out; `finish()` once the text has ended."""

    def __init__(self) -> None:
        self.held = ""  # content not yet emitted: trailing whitespace and a partial START
        self.after_call = False  # content since the last call's end starts after its whitespace
        self.said = False  # some content is out: content after a call keeps one separator from it
        self.gap = ""  # the whitespace just before the last call (the separator when none follows it)
        self.body: str | None = None  # inside a call: its text after START
        self.index = 0  # the next call's index
        self.named = False  # the current call's CallStart is out
        self.sent = 0  # characters of the current call's arguments sent

    def feed(self, text: str) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        while text:
            text = self._content(text, out) if self.body is None else self._call(text, out)
        return out

    def finish(self) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        if self.body is not None:
            self._close(self.body, self.body, out, ended=False)
        tail = self.held.lstrip() if self.after_call else self.held
        if tail:
            out.append(ContentDelta(tail))
        self.held = ""
        return out

    def _content(self, text: str, out: list[StreamEvent]) -> str:
        """Content up to a call's START (what follows is the call's); '' once all of `text` is used."""
        s = self.held + text
        at = s.find(START)
        if at >= 0:
            before = s[:at]
            self._emit(before.rstrip(), out)
            self.gap = before[len(before.rstrip()):]
            self.held, self.body, self.named, self.sent = "", "", False, 0
            return s[at + len(START):]
        keep = next((k for k in range(min(len(START) - 1, len(s)), 0, -1) if START.startswith(s[-k:])), 0)
        ready = s[:len(s) - keep]
        text_part = ready.rstrip()
        self._emit(text_part, out)
        self.held = ready[len(text_part):] + s[len(s) - keep:]
        return ""

    def _emit(self, text: str, out: list[StreamEvent]) -> None:
        if self.after_call:  # the whitespace around a call goes, but text on both sides stays apart
            body = text.lstrip()
            text = (text[:len(text) - len(body)] or self.gap) + body if body and self.said else body
        if text:
            out.append(ContentDelta(text))
            self.after_call = False
            self.said = True

    def _call(self, text: str, out: list[StreamEvent]) -> str:
        """A call's text; what follows its end goes back to content."""
        assert self.body is not None
        body = self.body + text
        found = scan(body)
        if found.malformed is not None:
            self.body = None
            self._emit(START + body[:found.malformed + 1], out)
            return body[found.malformed + 1:]
        self._send(found, body, out)
        if found.end is None:
            self.body = body
            return ""
        after = body[found.end:]
        rest = after.lstrip()
        if END.startswith(rest) and len(rest) < len(END):
            self.body = body  # the closing tag may still come
            return ""
        if rest.startswith(END):
            close_at = len(body) - len(rest) + len(END)
            self._close(body[:close_at], body[:found.end], out, ended=True)
            return body[close_at:]
        self._close(body[:found.end], body[:found.end], out, ended=True)  # no closing tag: ends at the object
        return after

    def _send(self, found: Scan, body: str, out: list[StreamEvent]) -> None:
        """The call's name once whole, then its arguments' text as far as it goes."""
        if found.name is None:
            return
        if not self.named:
            out.append(CallStart(self.index, found.name))
            self.named = True
        if found.args is not None:
            start, end = found.args
            now = body[start:end] if end is not None else body[start:].rstrip()
            if len(now) > self.sent:
                out.append(ArgumentsDelta(self.index, now[self.sent:]))
                self.sent = len(now)

    def _close(self, block: str, obj: str, out: list[StreamEvent], ended: bool) -> None:
        """The current call is over (`ended`: its object closed; else the text stopped inside it)."""
        self.body = None
        if not self.named:  # never a call: its text is content, unless the text stopped in it (markup cut short)
            if ended:
                self._emit(START + block, out)
            return
        if self.sent == 0 and ended:  # a closed call without arguments takes none; one cut short keeps ""
            out.append(ArgumentsDelta(self.index, "{}"))
        self.index += 1
        self.after_call = True
