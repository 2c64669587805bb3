"""Logprobs as jobs record them and as clients read them.

The output lane records, per token, one compact entry `[id, text, logprob, [[id, text, logprob], ...]]`
(the alternatives most likely first), a line of JSON each in the job's logprobs key and in its `token`
events; the prompt's (echo) as one document {text, tokens: [entries]} whose first entry's logprob is null.
A token that holds part of a character (a byte-level BPE token ending or starting inside it) has U+FFFD in its
text; its entry (or alternative) then ends with its bytes, a list of ints, which `bytes` reports instead of the
text's UTF-8, as OpenAI's do: joined, the tokens' bytes are the text's. These functions turn entries into OpenAI's
shapes: the chat (and job API) form, and the legacy completions form."""

from __future__ import annotations

import codecs
from typing import Any

import orjson

Entry = list[Any]  # [id, text, logprob | None, [[id, text, logprob(, bytes)], ...](, bytes)]


def parse_lines(data: str | bytes) -> list[Entry]:
    """Entries from their lines of JSON (a logprobs key, or a token event's field)."""
    if not data:
        return []
    raw = data.encode() if isinstance(data, str) else data
    return [orjson.loads(line) for line in raw.splitlines() if line]


def parse_prompt(data: str | bytes) -> tuple[str, list[Entry]] | None:
    """The prompt's text and entries, None when not recorded."""
    if not data:
        return None
    doc = orjson.loads(data)
    return doc["text"], doc["tokens"]


def _bytes(entry: Entry, at: int) -> list[int]:
    """A token's bytes: those its entry carries at `at` (a part of a character), else its text's UTF-8."""
    return entry[at] if len(entry) > at else list(entry[1].encode("utf-8"))


def chat_item(entry: Entry) -> dict[str, Any]:
    """One token as chat completions (and the job API) report it."""
    return {"token": entry[1], "logprob": entry[2], "bytes": _bytes(entry, 4),
            "top_logprobs": [{"token": a[1], "logprob": a[2], "bytes": _bytes(a, 3)} for a in entry[3]]}


def completion_logprobs(entries: list[Entry], offset: int = 0) -> dict[str, Any]:
    """Legacy completions logprobs: tokens, token_logprobs, top_logprobs (token -> logprob, the chosen
    token's included, as OpenAI's), text_offset (each token's start in the choice's text, from `offset`: where the
    character it starts, or the one it goes on with, begins)."""
    tokens: list[str] = []
    lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    at = offset
    chars = codecs.getincrementaldecoder("utf-8")(errors="replace")  # the text as the tokens' bytes give it
    for entry in entries:
        _, text, lp, top = entry[:4]
        tokens.append(text)
        lps.append(lp)
        if lp is None:
            tops.append(None)
        else:
            alts: dict[str, float] = {}
            for alt in top:  # most likely first: two tokens of one text keep the larger
                alts.setdefault(alt[1], alt[2])
            alts.setdefault(text, lp)
            tops.append(alts)
        offsets.append(at)
        at += len(chars.decode(bytes(_bytes(entry, 4))))  # a character split across tokens counts once, complete
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
