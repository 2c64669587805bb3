"""The door: every request is bounded before it is queued. Each reproduction of a request that once
crashed a worker or answered 500 answers 4xx here, with the one error object and a request id.

The API runs in process against the session's real Redis (a database of its own, no workers)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import httpx
import pytest
import redis
from fastapi import FastAPI

from api.main import create_app
from shared import names
from shared.limits import MAX_BODY_BYTES, TEMPERATURE_FLOOR
from shared.settings import Settings
from tests.helpers import in_process_api

VOCAB = 49152  # SmolLM2's config.json
DEEP = '{"a": ' * 100 + "1" + "}" * 100  # JSON nested 100 deep


@pytest.fixture
async def api(redis_server, model_path: str) -> AsyncIterator[httpx.AsyncClient]:  # type: ignore[no-untyped-def]
    url = redis_server.url.rsplit("/", 1)[0] + "/13"
    async with in_process_api(Settings(redis_url=url, model=model_path, max_tokens_cap=1000), _boom) as client:
        yield client


def _boom(app: FastAPI) -> None:
    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("secret internals: /etc/passwd")


def _is_error_object(r: httpx.Response) -> None:
    body = r.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"type", "message", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert r.headers.get("x-request-id")


RAW_JSON_REFUSED = [
    # path, raw JSON body (escapes kept as the client sent them), status
    ("/v1/jobs", '{"prompt": "hi", "top_k": 3000000000}', 422),
    ("/v1/jobs", '{"prompt": "hi", "min_p": 1.5}', 422),
    ("/v1/jobs", '{"prompt": "hi", "stop_token_ids": [99999999999]}', 422),
    ("/v1/jobs", f'{{"prompt": "hi", "top_k": {VOCAB + 1}}}', 422),
    ("/v1/jobs", f'{{"prompt": "hi", "stop_token_ids": [{VOCAB}]}}', 422),
    ("/v1/jobs", '{"prompt": "hi", "stop_token_ids": [-1]}', 422),
    ("/v1/jobs", '{"prompt": "\\ud800"}', 422),
    ("/v1/jobs", '{"messages": [{"role": "user", "content": "a\\udfff b"}]}', 422),
    ("/v1/jobs", '{"prompt": "nul \\u0000 here"}', 422),
    ("/v1/jobs", '{"prompt": "hi", "stop": ["\\ud800"]}', 422),
    ("/v1/jobs", '{"prompt": "hi", "seed": 99999999999999999999999}', 422),
    ("/v1/jobs", '{"prompt": "hi", "max_tokens": 3000000000}', 422),
    ("/v1/jobs", '{"prompt": "hi", "temperature": 1e400}', 422),
    ("/v1/jobs", '{"prompt": "hi", "stop": ["' + "x" * 300 + '"]}', 422),
    ("/v1/jobs", '{"prompt": "hi", "stop": ["a","b","c","d","e","f","g","h","i"]}', 422),
    ("/v1/jobs", '{"messages": [' + ",".join(['{"role": "user", "content": "x"}'] * 600) + "]}", 422),
    ("/v1/jobs", '{"prompt": "hi", "webhook_url": "http://user:pw@example.com/hook"}', 422),
    ("/v1/jobs", '{"prompt": "hi", "webhook_url": "http://example.com/a\\r\\nX-Evil: 1"}', 422),
    ("/v1/jobs", '{"prompt": "hi", "priority": 1001}', 422),
    ("/v1/jobs", '{"prompt": "hi", "priority": -1001}', 422),
    ("/v1/jobs", '{"prompt": "hi", "priority": 1.5}', 422),
    ("/v1/completions", '{"prompt": "hi", "priority": 99999999999999999999}', 400),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "priority": "high"}', 400),
    ("/v1/completions", '{"prompt": "hi", "stop": [""], "top_p": 5e-324}', 400),
    ("/v1/completions", '{"prompt": "hi", "stop": [""]}', 400),
    ("/v1/completions", '{"prompt": "\\ud800"}', 400),
    ("/v1/completions", '{"prompt": "hi", "top_k": 3000000000}', 400),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "min_p": -0.1}', 400),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', 400),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [99999999999]}',
     400),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\u0000"}]}]}',
     400),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "\\ud800": 1}', 400),
    # taken and ignored before (OpenAI and vLLM refuse both)
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "stream_options": '
                             '{"include_usage": true}}', 400),
    ("/v1/completions", '{"prompt": "hi", "n": 2, "best_of": 1}', 400),
    # a tool nested past the JSON serializer's recursion limit (a 500 on its way to Redis, or to a tokenizer)
    ("/v1/jobs", '{"prompt": "hi", "tools": [' + DEEP + ']}', 422),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
                             '"function": {"name": "f", "parameters": {"type": "object", "properties": {"x": '
                             + DEEP + '}}}}]}', 400),
    ("/tokenize", '{"messages": [{"role": "user", "content": "hi"}], "tools": [' + DEEP + ']}', 400),
    ("/v1/messages/count_tokens", '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": '
                                  '"hi"}], "tools": [{"name": "f", "input_schema": {"type": "object", "properties": '
                                  '{"x": ' + DEEP + '}}}]}', 400),
    # more text than a prompt may have: each tokenize call takes a tokenizer's loop, which jobs share, that long
    ("/tokenize", '{"messages": [' + ", ".join(['{"role": "user", "content": "' + "a" * 150_000 + '"}'] * 2) + "]}",
     413),
    ("/v1/messages/count_tokens", '{"model": "SmolLM2-135M-Instruct", "messages": ['
     + ", ".join(['{"role": "user", "content": "' + "a" * 150_000 + '"}'] * 2) + "]}", 400),  # (Anthropic's 400)
]


@pytest.mark.parametrize(("path", "raw", "status"), RAW_JSON_REFUSED)
async def test_hostile_requests_answer_4xx_with_the_error_object(api: httpx.AsyncClient, path: str, raw: str,
                                                                 status: int) -> None:
    r = await api.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    if path.startswith("/v1/messages"):  # Anthropic's error object
        assert r.json()["type"] == "error" and r.json()["error"]["message"], r.text
    else:
        _is_error_object(r)


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/chat/completions", "/v1/completions", "/v1/messages"])
async def test_a_json_body_sent_as_a_form_is_told_its_content_type(api: httpx.AsyncClient, path: str) -> None:
    """`curl -d '{...}'` without a content type sends the JSON as a form: the answer says what to send, where it
    said before that the input "should be a valid dictionary"."""
    r = await api.post(path, content='{"prompt": "Hi", "max_tokens": 4}',
                       headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code in (400, 422), r.text
    said = r.json()["error"]["message"]
    assert "Content-Type: application/json" in said and "application/x-www-form-urlencoded" in said, said


async def test_refused_requests_queue_nothing(api: httpx.AsyncClient, redis_server) -> None:  # type: ignore[no-untyped-def]
    for path, raw, _ in RAW_JSON_REFUSED:
        await api.post(path, content=raw, headers={"content-type": "application/json"})
    r = redis.Redis.from_url(redis_server.url.rsplit("/", 1)[0] + "/13")
    assert sum(r.xlen(s) for s in names.streams(names.JOBS)) == 0


async def test_tiny_temperature_and_top_p_are_floored(api: httpx.AsyncClient, redis_server) -> None:  # type: ignore[no-untyped-def]
    """Below the floors the request is accepted as greedy (temperature) or top-1 (top_p)."""
    r = await api.post("/v1/jobs", json={"prompt": "hi", "temperature": 1e-40, "top_p": 5e-324, "max_tokens": 2})
    assert r.status_code == 202, r.text
    client = redis.Redis.from_url(redis_server.url.rsplit("/", 1)[0] + "/13", decode_responses=True)

    def queued(job_id: str) -> dict:  # type: ignore[type-arg]
        entries = client.xrange(names.stream(names.JOBS, names.job_partition(job_id)))
        return json.loads(next(f["request"] for _, f in entries if f["job_id"] == job_id))

    stored = queued(r.json()["id"])
    assert stored["temperature"] == 0.0 and stored["top_p"] == 0.001
    r = await api.post("/v1/jobs", json={"prompt": "hi", "temperature": TEMPERATURE_FLOOR, "max_tokens": 2})
    assert queued(r.json()["id"])["temperature"] == TEMPERATURE_FLOOR


async def test_edges_of_the_vocabulary_are_accepted(api: httpx.AsyncClient) -> None:
    r = await api.post("/v1/jobs", json={"prompt": "hi", "top_k": VOCAB, "stop_token_ids": [0, VOCAB - 1],
                                         "seed": 2**64 - 1, "max_tokens": 1})
    assert r.status_code == 202, r.text
    r = await api.post("/v1/jobs", json={"prompt": "hi", "seed": -(2**63), "max_tokens": 1})
    assert r.status_code == 202, r.text


async def test_body_over_the_cap_is_413_before_parsing(api: httpx.AsyncClient) -> None:
    big = b'{"prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
    r = await api.post("/v1/jobs", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413
    _is_error_object(r)

    async def chunked():  # no Content-Length: the cap still holds
        for _ in range(MAX_BODY_BYTES // 65536 + 2):
            yield b"a" * 65536

    r = await api.post("/v1/jobs", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    _is_error_object(r)


async def test_request_id_on_every_answer(api: httpx.AsyncClient) -> None:
    r = await api.get("/healthz")
    assert len(r.headers["x-request-id"]) >= 16
    r = await api.get("/v1/jobs/job_nope", headers={"X-Request-Id": "client-chosen-42"})
    assert r.status_code == 404 and r.headers["x-request-id"] == "client-chosen-42"
    _is_error_object(r)
    r = await api.get("/v1/jobs/job_nope", headers={"X-Request-Id": "bad id with spaces"})
    assert r.headers["x-request-id"] != "bad id with spaces"
    r = await api.get("/no/such/route")
    assert r.status_code == 404
    _is_error_object(r)


async def test_a_500_shows_no_internals_and_is_logged_under_its_request_id(
        api: httpx.AsyncClient, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="conveyor.api"):
        r = await api.get("/boom", headers={"X-Request-Id": "trace-500"})
    assert r.status_code == 500
    _is_error_object(r)
    assert r.headers["x-request-id"] == "trace-500"
    assert "secret" not in r.text and "passwd" not in r.text and "Traceback" not in r.text
    assert "trace-500" in r.json()["error"]["message"]
    assert any("trace-500" in rec.getMessage() for rec in caplog.records)


def test_the_schema_states_the_bounds(model_path: str) -> None:
    schema = create_app(Settings(model=model_path, max_tokens_cap=300, default_max_tokens=16)).openapi()
    comps = schema["components"]["schemas"]
    job = comps["GenerationRequest"]["properties"]
    assert job["top_k"]["maximum"] == VOCAB and job["stop_token_ids"]["items"]["maximum"] == VOCAB - 1
    assert job["max_tokens"]["maximum"] == 300
    assert job["stop"]["maxItems"] == 8
    assert comps["GenerationRequest"]["oneOf"] == [{"required": ["prompt"]}, {"required": ["messages"]}]
    assert comps["ChatCompletionRequest"]["properties"]["max_completion_tokens"]["anyOf"][0]["maximum"] == 300
    chat = comps["ChatCompletionRequest"]["properties"]
    assert chat["messages"]["maxItems"] == 512
    links = schema["paths"]["/v1/jobs"]["post"]["responses"]["202"]["links"]
    assert {link["operationId"] for link in links.values()} == {"poll_job", "stream_job", "cancel_job"}
    for path in ("/v1/jobs", "/v1/completions", "/v1/chat/completions"):
        assert schema["paths"][path]["post"]["responses"]["422"]["content"]["application/json"]["schema"] == \
               {"$ref": "#/components/schemas/ErrorResponse"}


def test_null_means_the_default_on_optional_fields() -> None:
    """The SDKs send a None they are given as JSON null: an optional field's null reads as its default (a required
    field's stays refused)."""
    import pydantic

    from api.anthropic import MessagesRequest
    from api.openai_schemas import ChatCompletionRequest, CompletionRequest
    from api.responses import ResponseRequest

    hi = [{"role": "user", "content": "hi"}]
    chat = ChatCompletionRequest.model_validate({"messages": hi, "n": None, "presence_penalty": None,
                                                 "frequency_penalty": None, "stream": None, "parallel_tool_calls": None,
                                                 "stream_options": {"include_usage": None}})
    assert (chat.n, chat.presence_penalty, chat.stream, chat.parallel_tool_calls) == (1, 0.0, False, True)
    assert chat.stream_options is not None and chat.stream_options.include_usage is False
    assert CompletionRequest.model_validate({"prompt": "hi", "echo": None, "n": None}).echo is False
    resp = ResponseRequest.model_validate({"input": "hi", "store": None, "background": None, "stream": None})
    assert resp.store is True and resp.background is False
    msg = MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "messages": hi, "stream": None,
                                          "temperature": None})
    assert msg.stream is False
    with pytest.raises(pydantic.ValidationError):
        ChatCompletionRequest.model_validate({"messages": None})


async def test_a_model_is_retrieved_by_name(api: httpx.AsyncClient) -> None:
    """`client.models.retrieve(name)`: the entry /v1/models lists, or a 404 model_not_found."""
    listed = (await api.get("/v1/models")).json()["data"][0]
    r = await api.get(f"/v1/models/{listed['id']}")
    assert r.status_code == 200 and r.json() == listed
    r = await api.get("/v1/models/no-such-model")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert r.json()["error"]["type"] == "invalid_request_error"  # OpenAI's shape for it


@pytest.mark.parametrize(("path", "field", "body"), [
    ("/v1/chat/completions", "max_completion_tokens", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", "max_output_tokens", {"input": "hi"})])
async def test_a_limit_names_the_field_the_client_sent(api: httpx.AsyncClient, path: str, field: str,
                                                       body: dict[str, str]) -> None:
    r = await api.post(path, json={**body, field: 10**6})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert r.json()["error"]["message"].startswith(field)


@pytest.mark.parametrize(("body", "param"), [
    ({"stop": ["a"] * 9}, "stop"), ({"logit_bias": {"x": 1}}, "logit_bias.x"), ({"stop": 5}, "stop")])
async def test_a_refusal_names_the_field_not_a_union_branch(api: httpx.AsyncClient, body: dict[str, object],
                                                           param: str) -> None:
    r = await api.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **body})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param, error
    assert "[" not in error["message"].split(":")[0], error


async def test_input_items_list_calls_as_calls_newest_first_by_page(api: httpx.AsyncClient) -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
    given = [{"role": "user", "content": "Weather?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    r = await api.post("/v1/responses", json={"input": given, "tools": [tool], "background": True})
    assert r.status_code == 200, r.text
    page = (await api.get(f"/v1/responses/{r.json()['id']}/input_items")).json()
    assert [i["type"] for i in page["data"]] == ["function_call_output", "function_call", "message"]
    assert page["data"][0]["output"] == "sunny" and page["data"][2]["content"][0]["text"] == "Weather?"
    first = (await api.get(f"/v1/responses/{r.json()['id']}/input_items", params={"order": "asc", "limit": 1})).json()
    assert first["has_more"] and [i["type"] for i in first["data"]] == ["message"]
    rest = (await api.get(f"/v1/responses/{r.json()['id']}/input_items",
                          params={"order": "asc", "after": first["last_id"]})).json()
    assert [i["type"] for i in rest["data"]] == ["function_call", "function_call_output"] and not rest["has_more"]


async def test_files_list_filters_by_purpose_before_the_page(api: httpx.AsyncClient) -> None:
    """A page of one purpose holds that purpose's files, however many of another came later; a purpose this server
    holds none of lists none; `order=asc` oldest first."""
    ids = []
    for i in range(3):
        r = await api.post("/v1/files", files={"file": (f"in{i}.jsonl", b"{}\n")}, data={"purpose": "batch"})
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])
    page = (await api.get("/v1/files", params={"limit": 2, "purpose": "batch_output"})).json()
    assert page["data"] == [] and not page["has_more"]
    assert (await api.get("/v1/files", params={"purpose": "fine-tune"})).json()["data"] == []
    first = (await api.get("/v1/files", params={"limit": 2, "purpose": "batch"})).json()
    rest = (await api.get("/v1/files", params={"purpose": "batch", "after": first["last_id"]})).json()
    newest = [f["id"] for f in first["data"] + rest["data"]]
    assert first["has_more"] and not rest["has_more"] and sorted(newest) == sorted(ids)
    oldest = (await api.get("/v1/files", params={"order": "asc"})).json()
    assert [f["id"] for f in oldest["data"]] == newest[::-1]


async def test_a_page_after_a_file_deleted_meanwhile_goes_on_from_it(api: httpx.AsyncClient) -> None:
    """A client paging through its files and deleting some (the SDK sends the last id it saw as `after`) gets each
    file once: the page after a deleted file goes on from where that file was, not from the first page again."""
    for i in range(5):
        assert (await api.post("/v1/files", files={"file": (f"d{i}.jsonl", b"{}\n")},
                               data={"purpose": "batch"})).status_code == 200
    seen: list[str] = []
    after: str | None = None
    while True:
        page = (await api.get("/v1/files", params={"limit": 2, "purpose": "batch",
                                                   **({"after": after} if after else {})})).json()
        seen += [f["id"] for f in page["data"]]
        if not page["has_more"]:
            break
        after = page["last_id"]
        assert (await api.delete(f"/v1/files/{after}")).status_code == 200
    assert len(seen) == len(set(seen)) >= 5, seen


async def test_top_k_minus_one_is_all_and_min_tokens_meets_the_default_max(redis_server, model_path: str) -> None:  # type: ignore[no-untyped-def]
    """vLLM's `top_k: -1` (every token) is taken as 0; `min_tokens` without `max_tokens` is held to the deployment's
    default max_tokens (DEFAULT_MAX_TOKENS, 512 here), not the schema's (256)."""
    settings = Settings(redis_url=redis_server.url.rsplit("/", 1)[0] + "/13", model=model_path, max_tokens_cap=1000,
                        default_max_tokens=512)
    async with in_process_api(settings) as api:
        r = await api.post("/v1/jobs", json={"prompt": "hi", "top_k": -1, "max_tokens": 4})
        assert r.status_code == 202, r.text
        r = await api.post("/v1/jobs", json={"prompt": "hi", "min_tokens": 300})
        assert r.status_code == 202, r.text
        r = await api.post("/v1/jobs", json={"prompt": "hi", "min_tokens": 600})
        assert r.status_code == 422 and "min_tokens" in r.text, r.text


async def test_a_webhook_url_on_a_port_webhooks_cannot_reach_is_refused(redis_server, model_path: str) -> None:  # type: ignore[no-untyped-def]
    """WEBHOOK_PORTS set (infra/k8s: 80,443, what its NetworkPolicy lets the Celery worker reach): a job or batch
    whose webhook names another port is refused naming webhook_url (a 422 for a job, a 400 for a batch), not a
    webhook that fails for hours unseen."""
    settings = Settings(redis_url=redis_server.url.rsplit("/", 1)[0] + "/13", model=model_path, webhook_ports="80,443")
    async with in_process_api(settings) as api:
        for url in ("http://hooks.example.com:8080/h", "https://hooks.example.com:8443/h"):
            r = await api.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 4, "webhook_url": url})
            assert r.status_code == 422 and r.json()["error"]["param"] == "webhook_url", r.text
            assert "WEBHOOK_PORTS" in r.json()["error"]["message"]
            r = await api.post("/v1/batches", json={"input_file_id": "file_x", "endpoint": "/v1/chat/completions",
                                                    "completion_window": "24h", "webhook_url": url})
            assert r.status_code == 400 and r.json()["error"]["param"] == "webhook_url", r.text
        for url in ("http://hooks.example.com/h", "https://hooks.example.com/h", "https://hooks.example.com:80/h"):
            r = await api.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 4, "webhook_url": url})
            assert r.status_code == 202, r.text
    with pytest.raises(ValueError, match="WEBHOOK_PORTS"):
        Settings(webhook_ports="443,70000")
    with pytest.raises(ValueError):
        Settings(webhook_ports="https")


async def test_an_api_without_workers_takes_jobs_and_says_so(api: httpx.AsyncClient) -> None:
    """No worker runs here: the stack is not ready (/readyz), but this API process is (`pools=false`: its pod's
    readiness behind a Service), and it takes a job, which waits queued."""
    assert (await api.get("/readyz")).status_code == 503
    r = await api.get("/readyz", params={"pools": "false"})
    assert r.status_code == 200 and r.json()["status"] == "ready"
    assert (await api.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 4})).status_code == 202


async def test_an_adapter_of_lora_modules_that_cannot_be_served_stops_the_start(redis_server, model_path: str,  # type: ignore[no-untyped-def]
                                                                                tmp_path) -> None:
    """As vLLM: a LORA_MODULES adapter whose files are missing or do not fit stops the API's start, saying which;
    it was listed and took jobs that each failed on a worker."""
    settings = Settings(redis_url=redis_server.url.rsplit("/", 1)[0] + "/13", model=model_path,
                        lora_modules=f"bad={tmp_path}")
    with pytest.raises(SystemExit, match="LORA_MODULES: the adapter 'bad'"):
        async with in_process_api(settings):
            pass


async def test_one_models_backlog_neither_fills_nor_moves_another_models_queue(redis_server,  # type: ignore[no-untyped-def]
                                                                              model_path: str) -> None:
    """Each model's queue has its own depth: a backlog of one (its workers down) refuses that model's next jobs at
    MAX_QUEUED, not the other models' (idle, at position 1); a small MAX_QUEUED holds below the rate's floor."""
    url = redis_server.url.rsplit("/", 1)[0] + "/13"
    settings = Settings(redis_url=url, models=f"a={model_path},x={model_path}", max_queued=3)
    async with in_process_api(settings) as api:
        for _ in range(3):
            assert (await api.post("/v1/jobs", json={"prompt": "hi", "model": "x"})).status_code == 202
        over = await api.post("/v1/jobs", json={"prompt": "hi", "model": "x"})
        assert over.status_code == 429 and "capacity" in over.json()["error"]["message"]
        other = await api.post("/v1/jobs", json={"prompt": "hi", "model": "a"})
        assert other.status_code == 202 and other.json()["queue_position"] == 1, other.text
        assert (await api.get(f"/v1/jobs/{other.json()['id']}")).json()["queue_position"] == 1


def test_the_rate_leaves_each_partition_room_for_a_burst() -> None:
    """At a low measured rate the cap on waiting jobs falls to its floor; each partition holds its share of it, and a
    burst spreads over them unevenly. The floor grows with the partitions so that each keeps room for 8 (16 jobs sent
    at once to an idle cluster of 12 partitions were refused when 4 met in one); MAX_QUEUED still bounds it."""
    from api.quota import Throughput
    from api.store import partition_cap
    from shared import names

    slow = Throughput(None)  # type: ignore[arg-type]
    slow.rate = 0.1
    for n in (1, 12):
        with names.partitions_as(n):
            assert partition_cap(slow.queue_cap(10_000, 30)) >= (32 if n == 1 else 8)
            assert partition_cap(slow.queue_cap(3, 30)) == partition_cap(3)  # an operator's MAX_QUEUED holds


async def test_a_cancel_that_a_jobs_own_end_overtakes_answers_409(api: httpx.AsyncClient, redis_server) -> None:  # type: ignore[no-untyped-def]
    """A running job whose cancel is asked, and which reaches its own end before its worker heard: the cancel changed
    nothing, and says so as for any job already ended (409), not 200 with a job that succeeded."""
    from shared.job_ops import JobOps
    from shared.jobs import FinishReason

    r = redis.Redis.from_url(redis_server.url.rsplit("/", 1)[0] + "/13", decode_responses=True)
    job_id = (await api.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 4})).json()["id"]
    r.hset(names.job_key(job_id), "status", "running")  # as its worker's start would leave it
    asked = asyncio.create_task(api.post(f"/v1/jobs/{job_id}/cancel"))
    for _ in range(500):
        if r.hget(names.job_key(job_id), "cancel_requested"):
            break
        await asyncio.sleep(0.01)
    JobOps(r, 60).finish(job_id, FinishReason.length)  # the worker's end: its max_tokens reached
    got = await asked
    assert got.status_code == 409 and "succeeded" in got.json()["error"]["message"], got.text


async def test_include_stop_str_in_output_reaches_the_engines_request(api: httpx.AsyncClient, redis_server) -> None:  # type: ignore[no-untyped-def]
    """vLLM's `include_stop_str_in_output` is taken on the OpenAI routes and /v1/jobs (not refused, not dropped):
    it rides the job to the request the output lane reads (gpu_worker/detokenizer.py keeps the stop string)."""
    from api.openai_schemas import ChatCompletionRequest, CompletionRequest
    from shared.schemas import GenerationRequest

    for body in (ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stop=["x"],
                                       include_stop_str_in_output=True),  # type: ignore[list-item]
                 CompletionRequest(prompt="hi", stop=["x"], include_stop_str_in_output=True)):
        [req] = body.to_generation()
        assert req.tokenized("job_x", [1]).include_stop_str_in_output
    r = redis.Redis.from_url(redis_server.url.rsplit("/", 1)[0] + "/13")
    job = (await api.post("/v1/jobs", json={"prompt": "hi", "stop": ["x"], "include_stop_str_in_output": True})).json()
    [(_, entry)] = r.xrange(names.stream(names.JOBS, names.job_partition(job["id"])))
    wire = entry[b"request"]
    assert GenerationRequest.from_wire(wire).tokenized(job["id"], [1]).include_stop_str_in_output


def test_vllms_min_p_reaches_the_job() -> None:
    """`min_p` (vLLM's) on either OpenAI route is the job's; left out it is off."""
    from api.openai_schemas import ChatCompletionRequest, CompletionRequest

    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], min_p=0.05)
    [job] = chat.to_generation()
    assert job.min_p == 0.05 and job.tokenized("job_1", [1]).min_p == 0.05
    assert [j.min_p for j in CompletionRequest(prompt=["a", "b"], min_p=0.2).to_generation()] == [0.2, 0.2]
    assert CompletionRequest(prompt="a").to_generation()[0].min_p == 0.0
