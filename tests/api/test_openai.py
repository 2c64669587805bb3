"""The official openai client against the running stack."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from shared import names
from shared.signals import read_snapshot

MODEL = "SmolLM2-135M-Instruct"
MSG = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def oai(stack) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def door(app_client: httpx.AsyncClient) -> openai.AsyncOpenAI:
    """The client against the API in process (no workers): for what the door refuses."""
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", max_retries=0, http_client=app_client)


def test_models(oai: openai.OpenAI) -> None:
    """The served model, then the stack's LoRA adapter (LORA_MODULES), its parent the model."""
    listed = oai.models.list().data
    assert [m.id for m in listed] == [MODEL, "smol-lora"]
    assert getattr(listed[1], "parent", None) == MODEL and getattr(listed[0], "parent", "") is None


def test_chat_streamed_equals_non_streamed(oai: openai.OpenAI) -> None:
    full = oai.chat.completions.create(model=MODEL, messages=MSG, temperature=0, max_tokens=30)
    assert "Paris" in full.choices[0].message.content
    assert full.choices[0].finish_reason == "stop"
    assert full.usage.prompt_tokens > 0 and full.usage.completion_tokens > 0
    parts, usage, finish = [], None, None
    for chunk in oai.chat.completions.create(model=MODEL, messages=MSG, temperature=0, max_tokens=30, stream=True,
                                             stream_options={"include_usage": True}):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert "".join(parts) == full.choices[0].message.content
    assert finish == "stop"
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_completions_and_stop(oai: openai.OpenAI) -> None:
    r = oai.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=12,
                               seed=7, user="tester")
    text = r.choices[0].text
    assert text and r.usage.completion_tokens <= 12
    streamed = "".join(c.choices[0].text for c in oai.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=12, stream=True) if c.choices)
    assert streamed == text
    cut = oai.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=12,
                                 stop=[text.strip()[:3]])
    assert cut.choices[0].finish_reason == "stop" and text.strip()[:3] not in cut.choices[0].text


def test_a_stop_string_ends_the_count_at_its_token_under_speculation(oai: openai.OpenAI) -> None:
    """The stack decodes speculatively (a step may carry several tokens): the tokens counted and given logprobs end
    with the one that completed the stop string, as steps of one token would."""
    prompt = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,"  # (drafts the model takes)
    r = oai.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=30, stop=["8"], logprobs=1)
    choice = r.choices[0]
    tokens = choice.logprobs.tokens  # type: ignore[union-attr]
    assert choice.finish_reason == "stop" and r.usage.completion_tokens == len(tokens)
    assert "8" in "".join(tokens) and "8" not in "".join(tokens[:-1])


def test_max_completion_tokens_and_length(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(model=MODEL, messages=MSG, max_completion_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("extra", [
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}]},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
    {"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "[0-9]+"}},
    {"top_logprobs": 3}])
async def test_unsupported_options_are_refused(door: openai.AsyncOpenAI, extra: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(openai.BadRequestError) as err:
        await door.chat.completions.create(model=MODEL, messages=MSG, max_tokens=3, **extra)
    assert err.value.status_code == 400


async def test_unknown_model_and_bad_body(door: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        await door.chat.completions.create(model="gpt-9", messages=MSG, max_tokens=3)
    with pytest.raises(openai.BadRequestError):  # OpenAI's and vLLM's status for an invalid request
        await door.chat.completions.create(model=MODEL, messages=[], max_tokens=3)


def test_async_client(stack) -> None:  # type: ignore[no-untyped-def]
    async def main() -> list[str]:
        # closed in its loop: left open, the client's finalizer would close it later inside whatever loop runs then,
        # on connections of this closed one ("Event loop is closed", logged in another test)
        async with openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0) as client:
            calls = [client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}],
                                                    temperature=0, max_tokens=12)
                     for q in ("Say hi.", "Name a fruit.", "Name a color.")]
            return [r.choices[0].message.content for r in await asyncio.gather(*calls)]

    answers = asyncio.run(main())
    assert len(answers) == 3 and all(answers)


def _running(stack) -> int:  # type: ignore[no-untyped-def]

    r = stack.redis()
    return sum(w.running for w in read_snapshot(r, (names.INFERENCE_POOL,), {}).workers[names.INFERENCE_POOL])


def test_a_chat_cancelled_by_another_caller_ends_with_vllms_abort(stack) -> None:  # type: ignore[no-untyped-def]
    """The completion's id is its job's: a cancel of that job (POST /v1/jobs/{id}/cancel) ends the chat stream with
    vLLM's `abort`, a finish reason OpenAI clients meet from vLLM servers, not the native `cancelled`."""
    import json

    body = {"model": MODEL, "messages": MSG, "max_tokens": 900, "ignore_eos": True, "stream": True}
    reasons = []
    with httpx.Client(base_url=stack.url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as resp:
            for line in resp.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if not reasons:
                    reasons.append(None)
                    assert c.post(f"/v1/jobs/job_{chunk['id'].removeprefix('chatcmpl-')}/cancel").status_code == 200
                reasons += [choice["finish_reason"] for choice in chunk["choices"] if choice["finish_reason"]]
    assert reasons[1:] == ["abort"]


def test_disconnect_cancels_streaming_request(stack) -> None:  # type: ignore[no-untyped-def]
    body = {"model": MODEL, "messages": MSG, "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=stack.url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as resp:
            lines = 0
            cid = None
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    import json

                    cid = json.loads(line[6:])["id"]
                    lines += 1
                if lines >= 5:
                    break
        job_id = "job_" + cid.removeprefix("chatcmpl-")
        deadline = time.monotonic() + 10
        while c.get(f"/v1/jobs/{job_id}").json()["status"] != "cancelled":
            assert time.monotonic() < deadline, "dropped stream did not cancel its job"
            time.sleep(0.05)
        job = c.get(f"/v1/jobs/{job_id}").json()
        assert job["finish_reason"] == "cancelled" and job["usage"]["completion_tokens"] < 900
    deadline = time.monotonic() + 10
    while _running(stack) != 0:  # the engine slot is freed (heartbeats report every second)
        assert time.monotonic() < deadline
        time.sleep(0.2)
