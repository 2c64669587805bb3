"""Logprobs as jobs record them and as clients read them.

The output lane records, per token, one compact entry `[id, text, logprob, [[id, text, logprob], ...]]`
(the alternatives most likely first), a line of JSON each in the job's logprobs key and in its `token`
events; the prompt's (echo) as one document {text, tokens: [entries]} whose first entry's logprob is null.
These functions turn entries into OpenAI's shapes: the chat (and job API) form, and the legacy completions
form."""

from __future__ import annotations

from typing import Any

import orjson

Entry = list[Any]  # [id, text, logprob | None, [[id, text, logprob], ...]]


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


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_item(entry: Entry) -> dict[str, Any]:
    """One token as chat completions (and the job API) report it."""
    _, text, lp, top = entry
    return {"token": text, "logprob": lp, "bytes": _bytes(text),
            "top_logprobs": [{"token": t, "logprob": v, "bytes": _bytes(t)} for _, t, v in top]}


def completion_logprobs(entries: list[Entry], offset: int = 0) -> dict[str, Any]:
    """Legacy completions logprobs: tokens, token_logprobs, top_logprobs (token -> logprob, the chosen
    token's included, as OpenAI's), text_offset (each token's start in the choice's text, from `offset`)."""
    tokens: list[str] = []
    lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    at = offset
    for _, text, lp, top in entries:
        tokens.append(text)
        lps.append(lp)
        if lp is None:
            tops.append(None)
        else:
            alts: dict[str, float] = {}
            for _, t, v in top:  # most likely first: two tokens of one text keep the larger
                alts.setdefault(t, v)
            alts.setdefault(text, lp)
            tops.append(alts)
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
