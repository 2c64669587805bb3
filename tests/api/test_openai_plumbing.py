"""The OpenAI routes' plumbing, whatever the weights, on one Redis node and on a Redis Cluster: a
streamed answer is the non-streamed one, and a client that drops its stream cancels its job."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.helpers import until


@pytest.fixture
def oai(plumbing_stack) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=plumbing_stack.url + "/v1", api_key="unused", max_retries=0)


def _model(oai: openai.OpenAI) -> str:
    return oai.models.list().data[0].id


def test_chat_and_completions_streamed_equal_non_streamed(oai: openai.OpenAI) -> None:
    model, msg = _model(oai), [{"role": "user", "content": "Tell me about rivers."}]
    full = oai.chat.completions.create(model=model, messages=msg, temperature=0, max_tokens=12)
    streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
        model=model, messages=msg, temperature=0, max_tokens=12, stream=True) if c.choices)
    assert streamed == full.choices[0].message.content and full.usage.completion_tokens > 0
    text = oai.completions.create(model=model, prompt="Rivers are", temperature=0, max_tokens=12).choices[0].text
    assert text == "".join(c.choices[0].text for c in oai.completions.create(
        model=model, prompt="Rivers are", temperature=0, max_tokens=12, stream=True) if c.choices)


def test_a_prompt_over_the_context_is_a_400_streamed_or_not(oai: openai.OpenAI) -> None:
    """The tokenizer pool refuses it before it starts: a stream answers the same 400 (BadRequestError) as a
    request without one, rather than a 200 whose stream fails."""
    model, long = _model(oai), [{"role": "user", "content": "word " * 1500}]  # past the tests' 1,024 tokens
    with pytest.raises(openai.BadRequestError) as whole:
        oai.chat.completions.create(model=model, messages=long, max_tokens=8)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError) as streamed:
        list(oai.chat.completions.create(model=model, messages=long, max_tokens=8, n=2, stream=True))  # type: ignore[call-overload]
    assert streamed.value.body == whole.value.body


def test_a_dropped_stream_cancels_its_job(plumbing_stack, oai: openai.OpenAI) -> None:  # type: ignore[no-untyped-def]
    body = {"model": _model(oai), "messages": [{"role": "user", "content": "Count:"}], "max_tokens": 900,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=plumbing_stack.url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as resp:
            chunks = [json.loads(line[6:]) for line, _ in zip(
                (x for x in resp.iter_lines() if x.startswith("data: {")), range(3))]
        job_id = "job_" + chunks[0]["id"].removeprefix("chatcmpl-")
        job = until("the dropped stream's job to be cancelled",
                    lambda: (j := c.get(f"/v1/jobs/{job_id}").json())["status"] == "cancelled" and j, timeout=15)
        assert job["finish_reason"] == "cancelled" and job["usage"]["completion_tokens"] < 900


def test_per_token_features_on_either_redis(oai: openai.OpenAI) -> None:
    """Logprobs (and the prompt's, with echo over token ids), n choices, a grammar and a background response go
    through every stage's keys on one node and on a cluster alike (the step script's logprobs key, the prompt's
    logprobs, the compiled grammar's key)."""
    model = _model(oai)
    r = oai.completions.create(model=model, prompt=[[1, 2, 3, 4, 5], [6, 7, 8]], max_tokens=3, temperature=0,
                               logprobs=2, echo=True, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    for c in r.choices:
        lp = c.logprobs
        assert lp.token_logprobs[0] is None and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
        assert all(v <= 0 for v in lp.token_logprobs[1:])
    streamed = [c for chunk in oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=1, stream=True) for c in chunk.choices if c.logprobs and c.logprobs.content]
    assert streamed
    choice = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Pick"}], max_tokens=8,
                                         extra_body={"guided_choice": ["red", "blue"]})
    assert choice.choices[0].message.content in ("red", "blue")
    resp = oai.responses.create(model=model, input="Hi", background=True, max_output_tokens=4)
    until("the response ends", lambda: oai.responses.retrieve(resp.id).status in ("completed", "incomplete"),
          timeout=60)


def test_a_small_batch_on_either_redis(oai: openai.OpenAI) -> None:
    """A batch's keys (its record, lines, results, lease; its files) on one node and on a cluster alike."""
    import io

    model = _model(oai)
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/responses",
              "body": {"model": model, "input": f"Say {i}", "max_output_tokens": 3}} for i in range(5)]
    f = oai.files.create(file=("in.jsonl", io.BytesIO("".join(json.dumps(x) + "\n" for x in lines).encode())),
                         purpose="batch")
    batch = oai.batches.create(input_file_id=f.id, endpoint="/v1/responses", completion_window="24h")
    until("the batch completes", lambda: oai.batches.retrieve(batch.id).status == "completed", timeout=120,
          every=0.2)
    out = [json.loads(x) for x in oai.files.content(oai.batches.retrieve(batch.id).output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == [f"c{i}" for i in range(5)]
    assert all(o["response"]["body"]["object"] == "response" for o in out)
