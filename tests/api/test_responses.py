"""The Responses API through the official openai SDK, against the running stack: create and retrieve, with and
without background; a stream dropped and resumed with starting_after joins to output_text; cancel twice;
delete; previous_response_id continues a conversation; input_items; structured output through text.format;
another key sees 404 everywhere."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from shared import names
from tests.helpers import iter_sse, until

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture
def oai(stack) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


def test_create_and_retrieve(oai: openai.OpenAI) -> None:
    r = oai.responses.create(model=MODEL, input="What is the capital of France?", temperature=0,
                             max_output_tokens=20, metadata={"run": "1"})
    assert r.status == "completed" and "Paris" in r.output_text
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0 and r.metadata == {"run": "1"}
    again = oai.responses.retrieve(r.id)
    assert again.output_text == r.output_text and again.status == "completed"
    items = oai.responses.input_items.list(r.id)
    assert [i.role for i in items.data] == ["user"]
    # greedy: drawn at the default temperature, an answer may end by itself within 3 tokens (and be complete)
    short = oai.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=3, temperature=0)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "completed" and short.output[0].status == "incomplete"  # the message item too
    refused = oai.responses.create(model=MODEL, input="word " * 6000, background=True)  # over the context
    until("refused", lambda: oai.responses.retrieve(refused.id).status == "failed", timeout=60)
    assert oai.responses.retrieve(refused.id).error.code == "invalid_prompt"  # the request's fault, not the server's


def test_background_poll_and_cancel_twice_then_delete(oai: openai.OpenAI) -> None:
    r = oai.responses.create(model=MODEL, input="Count to one thousand.", background=True, max_output_tokens=900,
                             extra_body={"ignore_eos": True})
    assert r.status in ("queued", "in_progress")
    until("in progress", lambda: oai.responses.retrieve(r.id).status == "in_progress", timeout=60)
    first = oai.responses.cancel(r.id)
    second = oai.responses.cancel(r.id)
    assert first.status == second.status == "cancelled"
    done = oai.responses.create(model=MODEL, input="Say hi.", background=True, max_output_tokens=8)
    until("done", lambda: oai.responses.retrieve(done.id).status in ("completed", "incomplete"), timeout=60)
    oai.responses.delete(done.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(done.id)


def test_stream_dropped_and_resumed_joins_to_output_text(oai: openai.OpenAI, stack) -> None:  # type: ignore[no-untyped-def]
    r = oai.responses.create(model=MODEL, input="Describe the sea in two sentences.", background=True,
                             temperature=0, max_output_tokens=40)
    deltas: list[str] = []
    last = -1
    with httpx.Client(base_url=stack.url, timeout=60) as c:
        with c.stream("GET", f"/v1/responses/{r.id}", params={"stream": "true"}) as resp:
            for ev in iter_sse(resp):
                data = json.loads(ev["data"])
                last = data["sequence_number"]
                if data["type"] == "response.output_text.delta":
                    deltas.append(data["delta"])
                if len(deltas) >= 3:
                    break  # dropped mid-stream
    seen: list[str] = []
    stream = oai.responses.retrieve(r.id, stream=True, starting_after=last)
    for ev in stream:
        assert ev.sequence_number > last
        seen.append(ev.type)
        if ev.type == "response.output_text.delta":
            deltas.append(ev.delta)
        if ev.type == "response.completed":
            final = ev.response
    assert seen[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                         "response.completed"]
    assert "".join(deltas) == final.output_text == oai.responses.retrieve(r.id).output_text


def test_streamed_create_and_previous_response_id(oai: openai.OpenAI) -> None:
    events = list(oai.responses.create(model=MODEL, input="My name is Ada. Remember it.", temperature=0,
                                       max_output_tokens=20, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert events[0].response.status == "in_progress"  # (as OpenAI's: `queued` is a background response's)
    first = events[-1].response
    follow = oai.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                  temperature=0, max_output_tokens=20)
    alone = oai.responses.create(model=MODEL, input="What is my name?", temperature=0, max_output_tokens=20)
    assert follow.previous_response_id == first.id
    # the earlier turn (its input and its answer) went into the prompt: the model's own recall is not tested
    carried = follow.usage.input_tokens - alone.usage.input_tokens
    assert carried >= first.usage.output_tokens + 5, (carried, first.usage)


def test_text_format_json_schema(oai: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}
    r = oai.responses.create(model=MODEL, input="Name the capital of France as JSON.", max_output_tokens=40,
                             text={"format": {"type": "json_schema", "name": "city", "schema": schema}})
    assert set(json.loads(r.output_text)) == {"city"}


def test_store_false_is_not_kept_and_bad_requests(oai: openai.OpenAI) -> None:
    r = oai.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model=MODEL, input="Hi", background=True, store=False)
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model=MODEL, input=[{"type": "function_call_output", "call_id": "x", "output": "y"}])
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve("resp_nothing")


def test_logprobs_when_included_whole_and_streamed(oai: openai.OpenAI) -> None:
    """`include: ["message.output_text.logprobs"]` (with `top_logprobs`): each output token's logprob, whole and
    in the stream's deltas alike; without it, none."""
    ask = {"model": MODEL, "input": "Say hi.", "temperature": 0, "max_output_tokens": 5}
    r = oai.responses.create(**ask, include=["message.output_text.logprobs"], top_logprobs=2)  # type: ignore[call-overload]
    lps = r.output[0].content[0].logprobs  # type: ignore[union-attr]
    assert lps and "".join(lp.token for lp in lps) == r.output_text
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in lps)
    streamed = [e.logprobs for e in oai.responses.create(**ask, include=["message.output_text.logprobs"],  # type: ignore[call-overload]
                                                         top_logprobs=2, stream=True)
                if e.type == "response.output_text.delta"]
    assert [lp.token for d in streamed for lp in d] == [lp.token for lp in lps]
    plain = oai.responses.create(**ask)  # type: ignore[call-overload]
    assert not plain.output[0].content[0].logprobs  # type: ignore[union-attr]


def test_a_stream_resumed_anywhere_near_its_end_sends_exactly_what_follows(oai: openai.OpenAI) -> None:
    """Resumed after any event, the closing ones included (or at the very end), a stream sends the events that
    followed that one in the whole stream, numbered as there: never the closing events again, never a second end."""
    r = oai.responses.create(model=MODEL, input="Say hi.", temperature=0, max_output_tokens=6)
    whole = [(e.sequence_number, e.type) for e in oai.responses.retrieve(r.id, stream=True)]
    last = whole[-1][0]
    assert [s for s, _ in whole] == list(range(last + 1))
    for after in range(last - 5, last + 1):
        got = [(e.sequence_number, e.type) for e in oai.responses.retrieve(r.id, stream=True, starting_after=after)]
        assert got == [ev for ev in whole if ev[0] > after], after


def test_a_response_not_stored_leaves_nothing_behind(oai: openai.OpenAI, stack) -> None:  # type: ignore[no-untyped-def]
    """`store: false`: nothing of the response stays in the store once it is answered: streamed, or refused (a
    prompt over the context) as well as answered whole."""
    r = stack.redis()

    def unstored() -> set[str]:
        keys = {k.decode() if isinstance(k, bytes) else k for k in r.scan_iter(match=names.job_key("*"), count=1000)}
        return {k for k in keys if (meta := r.hget(k, "response")) and not json.loads(meta)["store"]}

    before = unstored()
    events = list(oai.responses.create(model=MODEL, input="Say hi.", store=False, stream=True, max_output_tokens=4))
    job = names.job_key("job_" + events[-1].response.id.removeprefix("resp_"))
    until("the streamed response's record gone", lambda: not r.exists(job), timeout=15)
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model=MODEL, input="word " * 6000, store=False)  # over the model's context
    oai.responses.create(model=MODEL, input="Say hi.", store=False, max_output_tokens=4)
    assert unstored() <= before


def test_a_create_sent_again_with_its_idempotency_key_is_the_same_response(stack) -> None:  # type: ignore[no-untyped-def]
    """The retry the README promises after a 503: the same Idempotency-Key and body answer the response the first
    call made (`Idempotent-Replayed`), another body under that key is refused."""
    body = {"model": MODEL, "input": "Say hi.", "max_output_tokens": 4, "background": True}
    headers = {"Idempotency-Key": "resp-retry-1"}
    with httpx.Client(base_url=stack.url, timeout=60) as c:
        first = c.post("/v1/responses", json=body, headers=headers)
        again = c.post("/v1/responses", json=body, headers=headers)
        other = c.post("/v1/responses", json={**body, "input": "Say bye."}, headers=headers)
    assert first.status_code == again.status_code == 200, (first.text, again.text)
    assert again.json()["id"] == first.json()["id"] and again.headers["idempotent-replayed"] == "true"
    assert other.status_code == 400 and other.json()["error"]["code"] == "idempotency_key_reused"


def test_truncation_auto_drops_the_oldest_turns_until_the_context_holds_it(oai: openai.OpenAI) -> None:
    """OpenAI's `truncation: auto`: a conversation over the model's context loses its oldest turns (never the
    instructions nor the last turn) until it fits; `disabled` (the default) refuses it."""
    context = oai.models.retrieve(MODEL).max_model_len  # type: ignore[attr-defined]
    turns = [{"role": "user" if k % 2 == 0 else "assistant", "content": f"Turn {k}: " + "word " * (context // 4)}
             for k in range(10)] + [{"role": "user", "content": "Say hi."}]
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model=MODEL, input=turns, max_output_tokens=8)  # type: ignore[arg-type]
    r = oai.responses.create(model=MODEL, input=turns, instructions="Be brief.", max_output_tokens=8,  # type: ignore[arg-type]
                             truncation="auto")
    assert r.status in ("completed", "incomplete") and r.usage is not None
    # the fewest turns dropped: the newest kept fill the context but for less than one more turn
    assert context - 8 - context // 4 - 10 < r.usage.input_tokens <= context - 8
    with pytest.raises(openai.BadRequestError, match="truncation"):  # (a value out of the field's, as others)
        oai.responses.create(model=MODEL, input="hi", truncation="sometimes")  # type: ignore[arg-type]


def test_a_function_call_cut_off_by_max_output_tokens_is_incomplete(oai: openai.OpenAI) -> None:
    """A call whose arguments max_output_tokens cut off is `incomplete`, whole and streamed, as its response is: an
    agent runs the `completed` ones, and this one's arguments are no object."""
    tool = {"type": "function", "name": "spell", "parameters": {
        "type": "object", "properties": {"word": {"type": "string", "pattern": "^[a-z]{80}$"}}, "required": ["word"]}}
    ask = {"model": MODEL, "input": "Spell a long word.", "tools": [tool], "tool_choice": "required",
           "max_output_tokens": 24}
    whole = oai.responses.create(**ask)  # type: ignore[call-overload]
    [call] = [i for i in whole.output if i.type == "function_call"]
    assert (whole.status, call.status) == ("incomplete", "incomplete"), (whole.status, call)
    events = list(oai.responses.create(**ask, stream=True))  # type: ignore[call-overload]
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert [c.status for c in done] == ["incomplete"] and events[-1].type == "response.incomplete"
    assert [i.status for i in events[-1].response.output if i.type == "function_call"] == ["incomplete"]


def test_an_unknown_previous_response_id_is_openais_previous_response_not_found(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        oai.responses.create(model=MODEL, input="Go on.", previous_response_id="resp_0123456789abcdef",
                             max_output_tokens=4)
    assert refused.value.code == "previous_response_not_found" and refused.value.param == "previous_response_id"
