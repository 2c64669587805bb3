"""A chunk's `token` event is written once, by the output lane, in the bytes the job API streams: the live
path forwards them untouched, a replay (resuming after a seq) writes the very same bytes, and the framings that
reshape events (OpenAI's) read the same text and logprobs from them."""

from __future__ import annotations

import orjson

from api import sse
from api.streaming import Cut, JobFraming, TokenEvent, _message
from shared.events import token_message
from shared.logprobs import chat_item, completion_logprobs

FRAMING = JobFraming({Cut.EXPIRED: (404, "the job expired")})
ENTRIES = [[42, "h\u00e9", -0.25, [[42, "h\u00e9", -0.25], [7, " x", -1.5]]], [9, "\n", -0.5, []]]


def _live(seq: int, text: str, entries: list) -> TokenEvent:  # type: ignore[type-arg]
    got, ev = _message(token_message(seq, text, entries))
    assert got == seq and ev is not None
    return ev


def test_live_and_replayed_events_are_the_bytes_clients_got_before() -> None:
    for seq, text, entries in ((1, "Hello", []), (7, 'say "hi"\n\u00e9\U0001f600', []), (12, "h\u00e9\n", ENTRIES),
                               (13, "", ENTRIES[:1])):
        data: dict[str, object] = {"seq": seq, "text": text}
        if entries:
            data["logprobs"] = [chat_item(e) for e in entries]
        expected = sse.encode(orjson.dumps(data), "token", seq)  # the job API's `token` event, as it always was
        replayed = TokenEvent(seq, text, entries or None)  # read back from the event stream's fields
        assert FRAMING.token(_live(seq, text, entries)) == FRAMING.token(replayed) == expected
        assert expected.startswith(b"event: token\r\nid: %d\r\ndata: {" % seq) and expected.count(b"\r\n") == 4


def test_framings_that_reshape_read_the_same_text_and_logprobs() -> None:
    live = _live(5, "h\u00e9\n", ENTRIES)
    assert live.text == "h\u00e9\n"
    assert live.logprobs is not None
    assert [chat_item(e) for e in live.logprobs] == [chat_item(e) for e in ENTRIES]
    assert completion_logprobs(live.logprobs, 3) == completion_logprobs(ENTRIES, 3)
    plain = _live(6, "no logprobs", [])
    assert plain.text == "no logprobs" and plain.logprobs is None


def test_done_and_older_json_messages_still_read() -> None:
    assert _message(b'{"type":"done","seq":9}') == (9, None)
    assert _message(b'{"seq":9,"type":"done"}') == (9, None)
    seq, ev = _message(orjson.dumps({"seq": 4, "type": "token", "text": "hi", "logprobs": ENTRIES}))
    assert seq == 4 and ev is not None and ev.text == "hi"
    assert FRAMING.token(ev) == FRAMING.token(_live(4, "hi", ENTRIES))


def test_a_live_stream_and_its_replay_send_the_same_bytes(plumbing_stack) -> None:  # type: ignore[no-untyped-def]
    """On a stack: the token events a client reads live (pub/sub) are byte for byte those a client resuming
    from the start reads back from the event stream once the job has ended, and they add up to the polled text."""
    import httpx

    from tests.helpers import submit, wait

    with httpx.Client(base_url=plumbing_stack.url, timeout=60) as client:
        job = submit(client, messages=[{"role": "user", "content": "Describe a river."}], temperature=0,
                     max_tokens=40, logprobs=True, top_logprobs=2)
        live = client.get(f"/v1/jobs/{job['id']}/events").content
        final = wait(client, job["id"])
        replay = client.get(f"/v1/jobs/{job['id']}/events", params={"after": 0}).content

    def tokens(body: bytes) -> list[bytes]:
        return [frame + b"\r\n\r\n" for frame in body.split(b"\r\n\r\n") if frame.startswith(b"event: token")]

    assert tokens(live) and tokens(live) == tokens(replay)
    texts = [orjson.loads(f.split(b"data: ", 1)[1]) for f in tokens(live)]
    assert "".join(t["text"] for t in texts) == final["text"]
    assert [t["seq"] for t in texts] == list(range(1, len(texts) + 1))
    assert all(len(t["logprobs"][0]["top_logprobs"]) == 2 for t in texts if t["text"])
