"""A job's `token` event in its final form, written once for both sides of the channel: the output lane publishes
`token_message` on the job's channel, and the API's job stream forwards its data untouched (a replayed chunk, read
from the event stream, gets the same bytes from `token_data`)."""

from __future__ import annotations

import orjson

from shared.logprobs import Entry, chat_item


def token_data(seq: int, text: str, entries: list[Entry] | None) -> bytes:
    """A `token` event's data as the job API's stream sends it: {"seq", "text"}, and "logprobs" (each token in
    the chat form) when it has entries."""
    data: dict[str, object] = {"seq": seq, "text": text}
    if entries:
        data["logprobs"] = [chat_item(e) for e in entries]
    return orjson.dumps(data)


def token_message(seq: int, text: str, entries: list[Entry] | None) -> bytes:
    """What a chunk publishes on its job's channel: its seq, a newline, then `token_data`. Any other message on
    the channel (finish.lua's `done`) is a JSON object, so its first byte tells the two apart."""
    return b"%d\n%s" % (seq, token_data(seq, text, entries))
