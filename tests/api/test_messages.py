"""Anthropic's Messages API through the official anthropic client: against the running stack (the real default
model) for generation, and against the API in process (no workers) for what the door answers."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterator

import anthropic
import httpx
import httpx2
import pytest
import redis

from api.main import create_app
from shared import names, tenants
from shared.limits import MAX_BODY_BYTES
from shared.settings import Settings
from tests.helpers import iter_sse

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}  # the client takes sampling controls as extra body fields (Anthropic's API has them)
EVENTS = ["message_start", "content_block_start", "ping", "content_block_delta", "content_block_stop",
          "message_delta", "message_stop"]


@pytest.fixture
def claude(stack) -> anthropic.Anthropic:  # type: ignore[no-untyped-def]
    return anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0)


DB = 9  # the in-process APIs' database


@pytest.fixture
def r(redis_server) -> Iterator[redis.Redis]:  # type: ignore[no-untyped-def]
    client = redis.Redis.from_url(redis_server.url.rsplit("/", 1)[0] + f"/{DB}", decode_responses=True)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


async def _in_process(redis_server, model_path: str, auth: str) -> AsyncIterator[httpx2.AsyncClient]:  # type: ignore[no-untyped-def]
    """The API in process (no workers) under the anthropic client's own HTTP library (httpx2)."""
    app = create_app(Settings(redis_url=redis_server.url.rsplit("/", 1)[0] + f"/{DB}", model=model_path, auth=auth,
                              max_tokens_cap=1000))
    async with app.router.lifespan_context(app):
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app), base_url="http://test") as client:
            yield client


@pytest.fixture
async def door(redis_server, model_path: str, r: redis.Redis) -> AsyncIterator[anthropic.AsyncAnthropic]:  # type: ignore[no-untyped-def]
    """The client against the API in process (no workers): for what the door refuses."""
    async for http in _in_process(redis_server, model_path, "off"):
        yield anthropic.AsyncAnthropic(base_url="http://test", api_key="unused", max_retries=0, http_client=http)


@pytest.fixture
async def keyed(redis_server, model_path: str, r: redis.Redis) -> AsyncIterator[httpx2.AsyncClient]:  # type: ignore[no-untyped-def]
    async for http in _in_process(redis_server, model_path, "required"):
        yield http


def test_a_message_and_its_stream_say_the_same(claude: anthropic.Anthropic) -> None:
    full = claude.messages.create(model=MODEL, max_tokens=30, extra_body=GREEDY, messages=ASK)
    assert full.id.startswith("msg_") and full.type == "message" and full.role == "assistant"
    assert full.model == MODEL and len(full.content) == 1 and full.content[0].type == "text"
    assert "Paris" in full.content[0].text
    assert full.stop_reason == "end_turn" and full.stop_sequence is None
    assert full.usage.input_tokens > 0 and full.usage.output_tokens > 0
    with claude.messages.stream(model=MODEL, max_tokens=30, extra_body=GREEDY, messages=ASK) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == full.content[0].text == final.content[0].text
    assert final.stop_reason == "end_turn" and final.id.startswith("msg_")
    assert (final.usage.input_tokens, final.usage.output_tokens) == (full.usage.input_tokens, full.usage.output_tokens)


def test_the_stream_is_anthropics_events_in_order(stack) -> None:  # type: ignore[no-untyped-def]
    body = {"model": MODEL, "max_tokens": 12, "temperature": 0, "messages": ASK, "stream": True}
    seen: list[str] = []
    with httpx.Client(base_url=stack.url, timeout=120) as client:
        with client.stream("POST", "/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            for ev in iter_sse(r):
                assert json.loads(ev["data"])["type"] == ev["event"], ev  # each event's name is its data's type
                seen.append(ev["event"])
    deltas = seen.count("content_block_delta")
    assert deltas >= 1 and seen == EVENTS[:3] + ["content_block_delta"] * deltas + EVENTS[4:]


def test_system_prompt_counts_as_the_message_does(claude: anthropic.Anthropic) -> None:
    system = "You are a geography teacher. Answer in one word."
    counted = claude.messages.count_tokens(model=MODEL, system=system, messages=ASK)
    bare = claude.messages.count_tokens(model=MODEL, messages=ASK)
    msg = claude.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, system=system, messages=ASK)
    assert counted.input_tokens == msg.usage.input_tokens
    longer = claude.messages.count_tokens(model=MODEL, system=system + " Be precise, and polite.", messages=ASK)
    # the model's template puts a system prompt of its own where none is given: the given one replaces it
    assert counted.input_tokens != bare.input_tokens and longer.input_tokens > counted.input_tokens
    blocks = claude.messages.count_tokens(model=MODEL, system=[{"type": "text", "text": system}],
                                          messages=[{"role": "user", "content": [{"type": "text",
                                                                                   "text": ASK[0]["content"]}]}])
    assert blocks.input_tokens == counted.input_tokens
    prefilled = [*ASK, {"role": "assistant", "content": "The answer is"}]  # continued, not answered
    msg = claude.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY, messages=prefilled)  # type: ignore[arg-type]
    assert claude.messages.count_tokens(model=MODEL, messages=prefilled).input_tokens == msg.usage.input_tokens  # type: ignore[arg-type]


def test_a_stop_sequence_ends_the_message_and_is_named(claude: anthropic.Anthropic) -> None:
    msg = claude.messages.create(model=MODEL, max_tokens=30, extra_body=GREEDY, messages=ASK,
                                 stop_sequences=["Paris", "never-written"])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "Paris"
    assert "Paris" not in msg.content[0].text
    with claude.messages.stream(model=MODEL, max_tokens=30, extra_body=GREEDY, messages=ASK,
                                stop_sequences=["Paris"]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == msg.content[0].text
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "Paris"
    short = claude.messages.create(model=MODEL, max_tokens=2, extra_body=GREEDY, messages=ASK)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2


async def test_refusals_are_anthropic_errors(door: anthropic.AsyncAnthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as e:
        await door.messages.create(model="claude-unknown", max_tokens=8, messages=ASK)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    assert e.value.request_id and e.value.request_id == e.value.response.headers["x-request-id"]  # (`request-id`)
    tool = {"name": "get_weather", "description": "weather", "input_schema": {"type": "object", "not": {}}}
    with pytest.raises(anthropic.BadRequestError) as e:
        await door.messages.create(model=MODEL, max_tokens=8, messages=ASK, tools=[tool])  # type: ignore[list-item]
    assert e.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "tools" in e.value.body["error"]["message"]  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        await door.messages.create(model=MODEL, max_tokens=5000, messages=ASK)


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": ASK}, "max_tokens"),
    ({"max_tokens": 8, "messages": ASK, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": "42"}]}]},
     "messages.0.content.0.tool_use_id: 't1' answers no earlier tool_use block"),
    ({"max_tokens": 8, "messages": [*ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "42"},
            {"type": "tool_result", "tool_use_id": "t2", "content": "43"}]}]}, "messages.2.content.1.tool_use_id"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]}, "messages.0"),
    ({"max_tokens": 8, "messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
    ({"max_tokens": 8, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"max_tokens": 8, "messages": ASK, "temperature": "hot"}, "temperature"),
    ({"max_tokens": 8, "messages": ASK, "stop_sequences": [""]}, "stop_sequences"),
    ({"max_tokens": 8, "messages": []}, "messages"),
    ({"max_tokens": 8, "messages": ASK, "tools": [{"name": "f", "input_schema": {"type": "string"}}]},
     "tools.0.input_schema.type"),  # a tool's input is an object (the SDK parses it as one)
    ({"max_tokens": 8, "messages": ASK, "tools": [{"name": "f", "input_schema": {"properties": {}}}]},
     "tools.0.input_schema.type"),
])
async def test_a_bad_body_is_a_400_in_anthropics_shape_naming_the_field(app_client: httpx.AsyncClient,
                                                                        body: dict[str, object], param: str) -> None:
    r = await app_client.post("/v1/messages", json={"model": MODEL, **body},
                              headers={"anthropic-version": "2023-06-01"})
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert param in err["error"]["message"]


async def test_the_service_at_capacity_is_a_529_overloaded_error(redis_server, model_path: str,  # type: ignore[no-untyped-def]
                                                                r: redis.Redis) -> None:
    """Anthropic's 529 `overloaded_error` (the SDK's OverloadedError, which a client falls back on), not a 429:
    no key is over its limits, the service is full (no workers here: the queue only grows)."""
    app = create_app(Settings(redis_url=redis_server.url.rsplit("/", 1)[0] + f"/{DB}", model=model_path,
                              max_queued=1))
    async with app.router.lifespan_context(app):
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app), base_url="http://test") as http:
            claude = anthropic.AsyncAnthropic(base_url="http://test", api_key="unused", max_retries=0,
                                              http_client=http)
            assert (await http.post("/v1/jobs", json={"prompt": "Hi", "max_tokens": 4})).status_code == 202
            with pytest.raises(anthropic.APIStatusError) as e:
                await claude.messages.create(model=MODEL, max_tokens=8, messages=ASK)
    assert e.value.status_code == 529 and e.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    assert e.value.response.headers["retry-after"]


async def test_a_body_over_the_cap_is_a_413_in_anthropics_shape(app_client: httpx.AsyncClient) -> None:
    big = b'{"max_tokens": 8, "messages": [{"role": "user", "content": "' + b"a" * MAX_BODY_BYTES + b'"}]}'
    r = await app_client.post("/v1/messages", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "request_too_large"
    # a prompt over MAX_PROMPT_CHARS in a body within the cap: Anthropic's 400 for a prompt too long
    long = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "a" * 240_000}]}
    r = await app_client.post("/v1/messages", json=long)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert "characters" in r.json()["error"]["message"]


async def test_tool_choice_auto_without_tools_is_accepted(app_client: httpx.AsyncClient) -> None:
    """It asks for nothing tools do: it reaches the model check like any request."""
    r = await app_client.post("/v1/messages", json={"model": "other", "max_tokens": 8, "messages": ASK,
                                                    "tool_choice": {"type": "auto"}})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


async def test_the_key_is_read_from_x_api_key(keyed: httpx2.AsyncClient, r: redis.Redis) -> None:
    key, _ = tenants.create(r, "acme")
    good = anthropic.AsyncAnthropic(base_url="http://test", api_key=key, max_retries=0, http_client=keyed)
    with pytest.raises(anthropic.NotFoundError):  # past the key: the model is what it refuses
        await good.messages.create(model="claude-unknown", max_tokens=8, messages=ASK)
    for wrong in ("cvk_wrong", key + "x"):
        bad = anthropic.AsyncAnthropic(base_url="http://test", api_key=wrong, max_retries=0, http_client=keyed)
        with pytest.raises(anthropic.AuthenticationError) as e:
            await bad.messages.create(model=MODEL, max_tokens=8, messages=ASK)
        assert e.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    resp = await keyed.post("/v1/messages", json={"model": MODEL, "max_tokens": 8, "messages": ASK})
    assert resp.status_code == 401 and resp.json()["type"] == "error"
    assert (await keyed.get("/v1/models", headers={"x-api-key": key})).status_code == 200


def test_a_request_the_pool_refuses_is_a_400_streamed_or_not(claude: anthropic.Anthropic) -> None:
    """A prompt longer than the context fails its job in the tokenizer pool before it starts: a 400 whether it
    streams or not (a stream opens once its job has left the queue), which the SDK raises as BadRequestError."""
    long = [{"role": "user", "content": "word " * 3000}]
    with pytest.raises(anthropic.BadRequestError) as whole:
        claude.messages.create(model=MODEL, max_tokens=8, messages=long)  # type: ignore[arg-type]
    with pytest.raises(anthropic.BadRequestError) as streamed:
        with claude.messages.stream(model=MODEL, max_tokens=8, messages=long) as s:  # type: ignore[arg-type]
            s.get_final_message()
    assert streamed.value.body == whole.value.body
    assert whole.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]


def test_a_cancelled_message_is_an_error_not_an_end_turn(stack) -> None:  # type: ignore[no-untyped-def]
    """A message whose job another caller cancels (`POST /v1/jobs/job_.../cancel`: a message's id is its job's) is
    cut short: an `error` event in its stream, a 409 without one, never `end_turn`."""
    ask = {"model": MODEL, "max_tokens": 600, "temperature": 1.0,
           "messages": [{"role": "user", "content": "Write a long story about a dragon."}]}
    with httpx.Client(base_url=stack.url, timeout=120) as client:
        with client.stream("POST", "/v1/messages", json={**ask, "stream": True}) as s:
            events = iter_sse(s)
            start = next(e for e in events if e["event"] == "message_start")
            job = "job_" + json.loads(start["data"])["message"]["id"].removeprefix("msg_")
            assert client.post(f"/v1/jobs/{job}/cancel").status_code == 200
            rest = list(events)
        assert rest[-1]["event"] == "error" and not any(e["event"] == "message_stop" for e in rest), rest[-3:]

        async def cancelled_while_it_runs() -> httpx.Response:
            """The request without a stream, its job (found by its prompt) cancelled before it ends (again, should
            the model end it first)."""
            store = redis.Redis.from_url(stack.redis_url, decode_responses=True)
            async with httpx.AsyncClient(base_url=stack.url, timeout=120) as a:
                for attempt in range(5):
                    mark = f"(cancel {attempt} {uuid.uuid4().hex[:8]})"
                    story = f"Write a long story about a dragon. {mark}"
                    marked = {**ask, "messages": [{"role": "user", "content": story}]}
                    sent = asyncio.create_task(a.post("/v1/messages", json=marked))
                    job = None
                    while job is None and not sent.done():  # its entry on its partition's `jobs` stream
                        await asyncio.sleep(0.02)
                        job = next((f["job_id"] for p in range(names.partition_count())
                                    for _, f in store.xrevrange(names.stream(names.JOBS, p), count=20)
                                    if mark in f.get("request", "")), None)
                    if job is not None and (await a.post(f"/v1/jobs/{job}/cancel")).status_code == 200:
                        return await sent
                    await sent
            raise AssertionError("every job ended before its cancel")

    got = asyncio.run(cancelled_while_it_runs())
    assert got.status_code == 409 and got.json()["error"]["type"] == "invalid_request_error", got.text


def test_a_trailing_assistant_message_is_continued(claude: anthropic.Anthropic) -> None:
    """Anthropic's prefill: the answer continues the assistant's text (and does not repeat it)."""
    start = "The capital of France is"
    msg = claude.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY,
                                 messages=[*ASK, {"role": "assistant", "content": start}])
    text = msg.content[0].text
    assert "Paris" in text and not text.lstrip().startswith(start), text
