"""vLLM's `/tokenize` and `/detokenize`, answered by the tokenizer pool: against the running stack (the default
model's tokenizer and chat template), and against the API in process, where no tokenizer runs."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from shared.tokenize_calls import CALL_TIMEOUT_S

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
TEXT = "The quick brown fox jumps over the lazy dog. Ünïcödé 東京 🦊"


@pytest.fixture
def api(stack) -> Iterator[httpx.Client]:  # type: ignore[no-untyped-def]
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def reference(model_path: str) -> Tokenizer:
    return Tokenizer.from_file(str(Path(model_path) / "tokenizer.json"))


def test_a_prompt_has_the_tokenizers_own_ids(api: httpx.Client, reference: Tokenizer) -> None:
    r = api.post("/tokenize", json={"prompt": TEXT})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == reference.encode(TEXT, add_special_tokens=True).ids
    assert body["count"] == len(body["tokens"]) and "token_strs" not in body
    assert body["max_model_len"] == api.get("/v1/models").json()["data"][0]["max_model_len"]
    strs = api.post("/tokenize", json={"model": "SmolLM2-135M-Instruct", "prompt": TEXT, "add_special_tokens": False,
                                       "return_token_strs": True}).json()
    assert strs["tokens"] == reference.encode(TEXT, add_special_tokens=False).ids
    assert strs["token_strs"] == [reference.id_to_token(i) for i in strs["tokens"]]


def test_messages_have_the_chat_templates_ids(api: httpx.Client, model_path: str) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(model_path)
    template = {"tokenize": True, "return_dict": False}
    with_prompt = api.post("/tokenize", json={"messages": CHAT}).json()
    without = api.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert with_prompt["tokens"] == hf.apply_chat_template(CHAT, add_generation_prompt=True, **template)
    assert without["tokens"] == hf.apply_chat_template(CHAT, add_generation_prompt=False, **template)
    assert with_prompt["count"] > without["count"]


def test_messages_take_the_chat_routes_shapes(api: httpx.Client, model_path: str) -> None:
    """Text parts, an assistant's tool calls with no content, `tools`, and a last assistant message continued
    (`continue_final_message`), as vLLM's /tokenize takes them."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(model_path)
    ask = CHAT[-1]["content"]
    parts = [{"role": "user", "content": [{"type": "text", "text": ask[:5]}, {"type": "text", "text": ask[5:]}]}]
    assert api.post("/tokenize", json={"messages": parts}).json() == api.post(  # joined as vLLM joins them
        "/tokenize", json={"messages": [{"role": "user", "content": ask[:5] + "\n" + ask[5:]}]}).json()
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    turns = [{"role": "user", "content": ask}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    r = api.post("/tokenize", json={"messages": turns, "tools": [tool]})
    assert r.status_code == 200 and r.json()["count"] > 0, r.text
    prefill = [{"role": "user", "content": ask}, {"role": "assistant", "content": "The answer is"}]
    r = api.post("/tokenize", json={"messages": prefill, "add_generation_prompt": False,
                                    "continue_final_message": True})
    assert r.json()["tokens"] == hf.apply_chat_template(prefill, continue_final_message=True, tokenize=True,
                                                         return_dict=False)


def test_detokenize_round_trips(api: httpx.Client, reference: Tokenizer) -> None:
    ids = api.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False}).json()["tokens"]
    r = api.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": TEXT}
    chat = api.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
    assert api.post("/detokenize", json={"tokens": chat}).json()["prompt"] == reference.decode(
        chat, skip_special_tokens=False)


def test_ids_outside_the_vocabulary_are_a_400(api: httpx.Client, reference: Tokenizer) -> None:
    vocab = reference.get_vocab_size(with_added_tokens=True)
    r = api.post("/detokenize", json={"tokens": [1, vocab]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens" and str(vocab) in r.text
    assert api.post("/detokenize", json={"tokens": [1, 2]}).status_code == 200  # and the pool goes on


_json = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40)
                     | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
                     lambda kids: st.lists(kids, max_size=4)
                     | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=12)
_fields = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from(["SmolLM2-135M-Instruct", "other", 5]), "prompt": _json | st.text(max_size=40),
    "messages": _json | st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "x"]),
                                                        "content": _json | st.text(max_size=20)}), max_size=3),
    "tokens": _json | st.lists(st.integers(-5, 60_000), max_size=8), "add_special_tokens": _json,
    "add_generation_prompt": _json, "return_token_strs": _json, "max_tokens": _json, "system": _json,
})


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/tokenize", "/detokenize", "/v1/messages/count_tokens"]), body=_fields | _json)
def test_odd_bodies_answer_4xx_never_500(api: httpx.Client, path: str, body: Any) -> None:
    r = api.post(path, json=body)
    assert r.status_code in (200, 400, 404, 413), (path, body, r.status_code, r.text)
    if r.status_code == 200 and path == "/tokenize":
        assert r.json()["count"] == len(r.json()["tokens"])


# --- no tokenizer running: the API in process ---------------------------------------------------------------------
@pytest.mark.slow
async def test_without_a_tokenizer_the_answer_is_a_503_in_time(app_client: httpx.AsyncClient) -> None:
    started = time.monotonic()
    r = await app_client.post("/tokenize", json={"prompt": "hello"})
    took = time.monotonic() - started
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable", r.text
    assert "tokenizer" in r.json()["error"]["message"] and r.headers["retry-after"]
    assert CALL_TIMEOUT_S - 0.5 <= took < CALL_TIMEOUT_S + 3
    r = await app_client.post("/v1/messages/count_tokens", json={"model": "SmolLM2-135M-Instruct",
                                                                 "messages": [{"role": "user", "content": "hi"}]})
    # (Anthropic's overloaded status, 529, which its SDKs raise as OverloadedError)
    assert r.status_code == 529 and r.json()["error"]["type"] == "overloaded_error" and r.json()["type"] == "error"


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "a"}]}, "messages.0.role"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "maybe"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "unknown": 1}, "unknown"),
    ("/detokenize", {"tokens": [-1]}, "tokens.0"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {"tokens": [2**40]}, "tokens.0"),
    ("/detokenize", {}, "tokens"),
])
async def test_a_bad_body_is_a_400_naming_the_field(app_client: httpx.AsyncClient, path: str, body: dict[str, Any],
                                                    param: str) -> None:
    r = await app_client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


async def test_another_model_is_a_404(app_client: httpx.AsyncClient) -> None:
    r = await app_client.post("/tokenize", json={"model": "gpt-9", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_calls_are_answered_on_one_node_and_on_a_cluster(plumbing_stack, reference: Tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The call's stream, reply key and channel share its partition's slot: the same answers on a Redis Cluster."""
    with httpx.Client(base_url=plumbing_stack.url, timeout=30) as client:
        for _ in range(8):  # calls go to partitions at random: a cluster's several masters are all reached
            r = client.post("/tokenize", json={"prompt": TEXT})
            assert r.status_code == 200, r.text
            assert r.json()["tokens"] == reference.encode(TEXT, add_special_tokens=True).ids
        back = client.post("/detokenize", json={"tokens": r.json()["tokens"]})
        assert back.status_code == 200 and back.json()["prompt"] == reference.decode(r.json()["tokens"],
                                                                                     skip_special_tokens=False)
        counted = client.post("/v1/messages/count_tokens", json={"model": plumbing_stack_model(client),
                                                                 "messages": [{"role": "user", "content": "hi"}]})
        assert counted.status_code == 200 and counted.json()["input_tokens"] > 1


def plumbing_stack_model(client: httpx.Client) -> str:
    return str(client.get("/v1/models").json()["data"][0]["id"])


def test_a_stack_whose_tokenizers_are_stopped_answers_503_in_time(tiny_stack) -> None:  # type: ignore[no-untyped-def]
    with httpx.Client(base_url=tiny_stack.url, timeout=30) as client:
        assert client.post("/tokenize", json={"prompt": "hello"}).status_code == 200
        tiny_stack.pause("tokenizer")
        try:
            started = time.monotonic()
            r = client.post("/tokenize", json={"prompt": "hello"})
            took = time.monotonic() - started
        finally:
            tiny_stack.resume("tokenizer")
        assert r.status_code == 503 and "no tokenizer answered" in r.json()["error"]["message"], r.text
        assert CALL_TIMEOUT_S - 0.5 <= took < CALL_TIMEOUT_S + 3
        assert client.post("/tokenize", json={"prompt": "hello"}).status_code == 200  # and after, answered again
