"""Tenants: API keys, jobs only their owner can see, per-key limits with OpenAI's rate-limit headers,
service-wide admission, and the operator's pages kept to the internal port.

Most run the API in process (auth required) against the session's real Redis with no workers, so
jobs stay queued; the rest run a whole stack with auth required and a tiny model."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import redis

from api.auth import CACHE_S
from api.main import create_app
from api.store import partition_cap
from infra.redis_server import free_port
from shared import names, tenants
from shared.job_ops import JobOps
from shared.jobs import FinishReason
from shared.settings import Settings
from tests.conftest import ROOT, Stack, lora_env, start_stack, stop_stack
from tests.helpers import conveyor, iter_sse

DB = 10


def _url(redis_server, db: int) -> str:  # type: ignore[no-untyped-def]
    return redis_server.url.rsplit("/", 1)[0] + f"/{db}"


@pytest.fixture
def r(redis_server) -> Iterator[redis.Redis]:  # type: ignore[no-untyped-def]
    client = redis.Redis.from_url(_url(redis_server, DB), decode_responses=True)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


async def _client(redis_server, model_path: str, **overrides) -> AsyncIterator[httpx.AsyncClient]:  # type: ignore[no-untyped-def]
    settings = Settings(redis_url=_url(redis_server, DB), model=model_path, auth="required", **overrides)
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
            yield client


@pytest.fixture
async def api(redis_server, model_path: str, r: redis.Redis) -> AsyncIterator[httpx.AsyncClient]:  # type: ignore[no-untyped-def]
    async for c in _client(redis_server, model_path):
        yield c


def queued(r: redis.Redis) -> int:
    """Entries in the jobs streams, every partition's."""
    return sum(r.xlen(s) for s in names.streams(names.JOBS))


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


JOB = {"prompt": "Hello", "max_tokens": 16}


async def test_no_key_a_wrong_key_and_a_revoked_key_get_401(api: httpx.AsyncClient, r: redis.Redis) -> None:
    key, _ = tenants.create(r, "acme")
    for headers in ({}, bearer("cvk_wrong"), {"Authorization": "Basic abc"}):
        resp = await api.post("/v1/jobs", json=JOB, headers=headers)
        assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error", resp.text
        assert resp.headers["www-authenticate"].startswith("Bearer")
    assert (await api.get("/v1/jobs/job_x", headers={})).status_code == 401
    assert (await api.post("/v1/jobs", json=JOB, headers=bearer(key))).status_code == 202
    tenants.revoke(r, "acme")
    resp = await api.post("/v1/jobs", json=JOB, headers=bearer(key))  # the submit script checks the key itself
    assert resp.status_code == 401 and "revoked" in resp.json()["error"]["message"]
    deadline = time.monotonic() + CACHE_S + 5  # reads trust the key cache until its entry expires
    while (await api.get("/v1/jobs/job_x", headers=bearer(key))).status_code != 401:
        assert time.monotonic() < deadline, "a revoked key still reads past the key cache's lifetime"
        await asyncio.sleep(0.05)
    assert r.get(names.api_key_index(tenants.hash_key(key))) == "acme"
    assert key not in json.dumps(r.hgetall(names.tenant_key("acme")))  # only its digest is stored


async def test_each_tenant_sees_only_its_own_jobs(api: httpx.AsyncClient, r: redis.Redis) -> None:
    a, _ = tenants.create(r, "a")
    b, _ = tenants.create(r, "b")
    job = (await api.post("/v1/jobs", json=JOB, headers=bearer(a))).json()
    for method, path in (("GET", f"/v1/jobs/{job['id']}"), ("GET", f"/v1/jobs/{job['id']}/events"),
                         ("POST", f"/v1/jobs/{job['id']}/cancel")):
        resp = await api.request(method, path, headers=bearer(b))
        assert resp.status_code == 404, (path, resp.text)
        nowhere = await api.request(method, path.replace(job["id"], "job_" + "0" * 32), headers=bearer(b))
        assert resp.json()["error"]["message"].replace(job["id"], "X") == \
               nowhere.json()["error"]["message"].replace("job_" + "0" * 32, "X")  # nothing tells them apart
    mine = await api.get(f"/v1/jobs/{job['id']}", headers=bearer(a))
    assert mine.status_code == 200 and mine.json()["status"] == "queued" and "owner" not in mine.json()
    assert (await api.post(f"/v1/jobs/{job['id']}/cancel", headers=bearer(a))).status_code == 200


async def test_idempotency_keys_are_per_tenant_and_bound_to_the_body(api: httpx.AsyncClient, r: redis.Redis) -> None:
    a, _ = tenants.create(r, "a")
    b, _ = tenants.create(r, "b")
    idem = {"Idempotency-Key": "order-1"}
    first = await api.post("/v1/jobs", json=JOB, headers={**bearer(a), **idem})
    again = await api.post("/v1/jobs", json=JOB, headers={**bearer(a), **idem})
    assert again.json()["id"] == first.json()["id"] and again.headers["idempotent-replayed"] == "true"
    other = await api.post("/v1/jobs", json=JOB, headers={**bearer(b), **idem})
    assert other.status_code == 202 and other.json()["id"] != first.json()["id"]
    changed = await api.post("/v1/jobs", json={**JOB, "max_tokens": 5}, headers={**bearer(a), **idem})
    assert changed.status_code == 422 and changed.json()["error"]["code"] == "idempotency_key_reused"


async def test_a_burst_over_rpm_gets_429_with_retry_after_and_headers(api: httpx.AsyncClient, r: redis.Redis) -> None:
    key, _ = tenants.create(r, "burst", rpm=5, tpm=0)
    remaining = []
    for _ in range(5):
        resp = await api.post("/v1/jobs", json=JOB, headers=bearer(key))
        assert resp.status_code == 202
        assert resp.headers["x-ratelimit-limit-requests"] == "5"
        remaining.append(int(resp.headers["x-ratelimit-remaining-requests"]))
        assert resp.headers["x-ratelimit-reset-requests"].endswith("s")
        assert "x-ratelimit-limit-tokens" not in resp.headers  # no token limit on this key
    assert remaining == [4, 3, 2, 1, 0]
    resp = await api.post("/v1/jobs", json=JOB, headers=bearer(key))
    assert resp.status_code == 429
    assert resp.json()["error"] == {"type": "rate_limit_error", "code": "rate_limit_exceeded", "param": None,
                                    "message": resp.json()["error"]["message"]}
    assert 1 <= int(resp.headers["retry-after"]) <= 13  # a token comes back every 12 s
    assert resp.headers["x-ratelimit-remaining-requests"] == "0"
    assert queued(r) == 5  # the refused request queued nothing


async def test_token_reservations_come_back_when_a_job_ends_early(api: httpx.AsyncClient, r: redis.Redis) -> None:
    key, _ = tenants.create(r, "tok", rpm=0, tpm=100)
    first = await api.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 60}, headers=bearer(key))
    assert first.status_code == 202 and first.headers["x-ratelimit-limit-tokens"] == "100"
    assert int(first.headers["x-ratelimit-remaining-tokens"]) == 100 - 61  # 1 for the prompt, 60 to generate
    second = await api.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 60}, headers=bearer(key))
    assert second.status_code == 429 and second.headers["x-ratelimit-limit-tokens"] == "100"
    assert int(second.headers["retry-after"]) >= 1
    too_big = await api.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 200}, headers=bearer(key))
    assert too_big.status_code == 429 and too_big.json()["error"]["code"] == "request_too_large"
    assert too_big.headers["x-should-retry"] == "false" and "retry-after" not in too_big.headers
    await api.post(f"/v1/jobs/{first.json()['id']}/cancel", headers=bearer(key))  # it ends without a token
    third = await api.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 60}, headers=bearer(key))
    assert third.status_code == 202, third.text
    assert int(third.headers["x-ratelimit-remaining-tokens"]) >= 100 - 61 - 1


async def test_tokens_used_past_the_reservation_are_charged_when_a_job_ends(api: httpx.AsyncClient,
                                                                           r: redis.Redis) -> None:
    """The door reserves a prompt's tokens by its characters (it never tokenizes): a prompt denser in tokens (emoji,
    say) used more than it reserved, and the rest was never charged. Its end charges it, down to -tpm at most: the
    key's next requests wait for the bucket to refill."""
    key, _ = tenants.create(r, "dense", rpm=0, tpm=1000)
    first = await api.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 10}, headers=bearer(key))
    assert first.status_code == 202
    job_id = first.json()["id"]
    JobOps(r, 60).finish(job_id, FinishReason.stop, fields={"prompt_tokens": 1500, "completion_tokens": 10})
    left = float(r.hget(names.tenant_bucket_key("dense", "tokens"), "t"))
    assert -1000 <= left < -500  # 11 reserved, 1,510 used
    later = await api.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 10}, headers=bearer(key))
    assert later.status_code == 429 and int(later.headers["retry-after"]) >= 30


async def test_tokenize_calls_spend_the_keys_requests_per_minute(api: httpx.AsyncClient, r: redis.Redis) -> None:
    """/tokenize, /detokenize and count_tokens are answered by the tokenizer pool every tenant shares: each spends a
    request of its key's rpm, as a job does, so a key over its limit cannot flood that pool with calls."""
    key, _ = tenants.create(r, "counter", rpm=1, tpm=0)
    assert (await api.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 2}, headers=bearer(key))).status_code == 202
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]}),
                       ("/v1/messages/count_tokens", {"model": "SmolLM2-135M-Instruct",
                                                      "messages": [{"role": "user", "content": "hi"}]})):
        got = await api.post(path, json=body, headers=bearer(key))
        assert got.status_code == 429 and "requests per minute" in got.json()["error"]["message"], (path, got.text)


async def test_an_upload_without_a_valid_key_is_refused_before_its_body_is_read(api: httpx.AsyncClient,
                                                                                r: redis.Redis) -> None:
    """An upload may be 64 MiB: without a valid key it is refused before its body is read (the route's own check
    came after its form was parsed, the whole file spooled to disk by anyone who could reach the port)."""
    pulled: list[int] = []

    head = b'--b\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n\r\n'

    async def body() -> AsyncIterator[bytes]:  # a file part that goes on and on
        for i in range(64):
            pulled.append(i)
            yield (head if i == 0 else b"") + b"x" * 65536

    headers = {"content-type": "multipart/form-data; boundary=b", "content-length": str(len(head) + 64 * 65536)}
    for auth in ({}, bearer("cvk_not-a-key")):
        pulled.clear()
        got = await api.post("/v1/files", content=body(), headers={**headers, **auth})
        assert got.status_code == 401 and len(pulled) <= 1, (got.status_code, len(pulled))
    key, _ = tenants.create(r, "uploader")
    up = await api.post("/v1/files", files={"file": ("in.jsonl", b'{"a": 1}\n')}, data={"purpose": "batch"},
                        headers=bearer(key))
    assert up.status_code == 200, up.text


async def test_a_request_of_several_choices_is_one_request_and_fits_whole_or_not_at_all(
        api: httpx.AsyncClient, r: redis.Redis) -> None:
    """`n` choices (or a list of prompts) are one request of the key's requests per minute, whose tokens are
    reserved together: one that can never fit, more tokens than a minute's or more choices than the key's unfinished
    jobs, is `request_too_large` (no retry helps it), and a refusal charges nothing."""
    chat = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    key, _ = tenants.create(r, "choosy", rpm=3, tpm=0, max_queued=3)
    asked = asyncio.create_task(api.post("/v1/chat/completions", json={**chat, "n": 3}, headers=bearer(key)))
    try:
        for _ in range(500):  # the three choices queued (the request itself waits for them: no worker runs here)
            if queued(r) == 3 or asked.done():
                break
            await asyncio.sleep(0.01)
        assert queued(r) == 3 and not asked.done(), asked.result().text if asked.done() else queued(r)
        one = await api.post("/v1/jobs", json=JOB, headers=bearer(key))  # over max_queued, not over rpm
        assert one.status_code == 429 and "unfinished" in one.json()["error"]["message"], one.text
        left = float(r.hget(names.tenant_bucket_key("choosy", "requests"), "t"))
        assert 1.9 < left < 2.2, left  # one request of three taken, not three
    finally:
        asked.cancel()
    too_many = await api.post("/v1/chat/completions", json={**chat, "n": 4}, headers=bearer(key))
    assert too_many.status_code == 429 and too_many.json()["error"]["code"] == "request_too_large", too_many.text
    assert too_many.headers["x-should-retry"] == "false" and "retry-after" not in too_many.headers

    key, _ = tenants.create(r, "wordy", rpm=100, tpm=300)
    for path, body in (("/v1/chat/completions", {**chat, "max_tokens": 200, "n": 2}),
                       ("/v1/completions", {"model": chat["model"], "prompt": ["a", "b", "c"], "max_tokens": 150})):
        got = await api.post(path, json=body, headers=bearer(key))
        assert got.status_code == 429 and got.json()["error"]["code"] == "request_too_large", (path, got.text)
        assert got.headers["x-should-retry"] == "false"
    fits = await api.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 250}, headers=bearer(key))
    assert fits.status_code == 202, fits.text  # the refusals took none of the bucket's tokens nor its requests
    assert fits.headers["x-ratelimit-remaining-requests"] == "99"


async def test_unfinished_jobs_per_key_are_capped(api: httpx.AsyncClient, r: redis.Redis) -> None:
    key, _ = tenants.create(r, "q", max_queued=2)
    ids = [(await api.post("/v1/jobs", json=JOB, headers=bearer(key))).json()["id"] for _ in range(2)]
    resp = await api.post("/v1/jobs", json=JOB, headers=bearer(key))
    assert resp.status_code == 429 and "unfinished" in resp.json()["error"]["message"]
    assert resp.headers["retry-after"]
    await api.post(f"/v1/jobs/{ids[0]}/cancel", headers=bearer(key))
    assert (await api.post("/v1/jobs", json=JOB, headers=bearer(key))).status_code == 202


async def test_service_wide_admission_answers_429_at_depth(redis_server, model_path: str,  # type: ignore[no-untyped-def]
                                                           r: redis.Redis) -> None:
    key, _ = tenants.create(r, "big", rpm=0, tpm=0, max_queued=0)
    fits = partition_cap(3)  # a tenant's jobs share its partition: 3 with one, its share with several
    async for api in _client(redis_server, model_path, max_queued=3):
        for _ in range(fits):
            assert (await api.post("/v1/jobs", json=JOB, headers=bearer(key))).status_code == 202
        resp = await api.post("/v1/jobs", json=JOB, headers=bearer(key))
        assert resp.status_code == 429 and resp.json()["error"]["code"] == "server_overloaded"
        assert int(resp.headers["retry-after"]) >= 1
        assert queued(r) == fits


def test_conveyor_keys_create_list_revoke(redis_server, r: redis.Redis, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    env = {"REDIS_URL": _url(redis_server, DB), "CONVEYOR_CACHE": str(tmp_path)}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return conveyor("keys", *args, env=env)

    made = run("create", "team-a", "--rpm", "7", "--max-streams", "2", "--weight", "2.5")
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip().splitlines()[-1]
    assert key.startswith(tenants.KEY_PREFIX) and r.get(names.api_key_index(tenants.hash_key(key))) == "team-a"
    assert r.hget(names.tenant_key("team-a"), "weight") == "2.5"
    assert run("create", "team-a").returncode == 1  # taken
    for weight in ("0", "-1", "101", "nan"):
        bad = run("create", "team-w", "--weight", weight)
        assert bad.returncode != 0 and "weight" in bad.stderr and not r.exists(names.tenant_key("team-w")), weight
    for flag in ("--rpm", "--tpm", "--max-queued", "--max-streams", "--batch-tpm", "--max-file-bytes"):
        bad = run("create", "team-n", flag, "-5")  # the scripts take a cap <= 0 for none: -5 was no limit at all
        assert bad.returncode == 1 and "0 (no limit) or more" in bad.stderr, flag
        assert not r.exists(names.tenant_key("team-n")), flag
    listed = run("list").stdout
    assert "team-a" in listed and " 7 " in listed and " 2.5 " in listed and key not in listed and "active" in listed
    assert run("revoke", "team-a").returncode == 0
    assert "revoked" in run("list").stdout
    assert run("revoke", "nobody").returncode == 1
    assert run("create", "bad name!").returncode == 1


def test_up_refuses_a_public_host_without_auth(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOST": "0.0.0.0", "AUTH": "off", "CONVEYOR_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "infra.cli", "up"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0 and "AUTH=required" in out.stderr


# --- a whole stack with auth required ---------------------------------------------------------------

@pytest.fixture(scope="module")
def auth_stack(tmp_path_factory: pytest.TempPathFactory, redis_server, tiny_model_dir: str,  # type: ignore[no-untyped-def]
               tiny_loras: dict[str, str]) -> Iterator[Stack]:
    url = _url(redis_server, 9)
    redis.Redis.from_url(url).flushdb()
    internal = free_port()
    s = start_stack(tmp_path_factory.mktemp("auth-stack"), url, tiny_model_dir,
                    extra={"AUTH": "required", "HOST": "0.0.0.0", "INTERNAL_PORT": str(internal),
                           "MAX_TOKENS_CAP": "64", "DEFAULT_MAX_TOKENS": "16", **lora_env(tiny_loras, ["tiny-all"])})
    s.internal_url = f"http://127.0.0.1:{internal}"  # type: ignore[attr-defined]
    yield s
    stop_stack(s)


def test_a_key_limited_to_some_models_finds_no_other(auth_stack: Stack, tiny_loras: dict[str, str]) -> None:
    """`conveyor keys create --models`: the key sees and may name only its models (any other: 404, as a model that
    does not exist); the run-time LoRA endpoints answer on the internal port only."""
    r = auth_stack.redis()
    narrow, _ = tenants.create(r, "narrow", models=("tiny-all",))
    wide, _ = tenants.create(r, "wide")
    base = openai.OpenAI(base_url=auth_stack.url + "/v1", api_key=wide, max_retries=0).models.list().data[0].id
    for key, sees in ((narrow, ["tiny-all"]), (wide, [base, "tiny-all"])):
        oai = openai.OpenAI(base_url=auth_stack.url + "/v1", api_key=key, max_retries=0)
        assert [m.id for m in oai.models.list().data] == sees
        assert oai.completions.create(model="tiny-all", prompt="Hi", max_tokens=2).model == "tiny-all"
    oai = openai.OpenAI(base_url=auth_stack.url + "/v1", api_key=narrow, max_retries=0)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oai.completions.create(model=base, prompt="Hi", max_tokens=2)
    h = {"Authorization": f"Bearer {narrow}"}
    job = httpx.post(f"{auth_stack.url}/v1/jobs", json={"prompt": "Hi", "max_tokens": 2}, headers=h)
    assert job.status_code == 404 and job.json()["error"]["code"] == "model_not_found"
    assert base not in job.json()["error"]["message"].split("does not exist", 1)[1]  # nor named as one it runs
    body = {"lora_name": "late", "lora_path": tiny_loras["tiny-late"]}
    assert httpx.post(f"{auth_stack.url}/v1/load_lora_adapter", json=body, headers=h).status_code == 404
    internal = auth_stack.internal_url  # type: ignore[attr-defined]
    assert httpx.post(f"{internal}/v1/load_lora_adapter", json=body).status_code == 200
    assert httpx.post(f"{internal}/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
    assert [t["models"] for t in tenants.list_all(r) if t["name"] in ("narrow", "wide")] == [["tiny-all"], []]


def test_openai_sdk_with_a_real_key_and_ownership_of_its_ids(auth_stack: Stack) -> None:
    r = auth_stack.redis()
    a, _ = tenants.create(r, "sdk-a")
    b, _ = tenants.create(r, "sdk-b")
    client = openai.OpenAI(base_url=auth_stack.url + "/v1", api_key=a, max_retries=0)
    model = client.models.list().data[0].id
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=5, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens >= 1
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert raw.headers["x-ratelimit-limit-requests"] == str(tenants.DEFAULT_LIMITS["rpm"])
    job_id = "job_" + out.id.removeprefix("chatcmpl-")
    assert httpx.get(f"{auth_stack.url}/v1/jobs/{job_id}", headers=bearer(a)).status_code == 200
    assert httpx.get(f"{auth_stack.url}/v1/jobs/{job_id}", headers=bearer(b)).status_code == 404
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=auth_stack.url + "/v1", api_key="cvk_nope", max_retries=0).models.list()
    # a call that is no job spends a request too, and says what is left as a job's answer does
    c, _ = tenants.create(r, "sdk-c", rpm=10)
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]})):
        got = httpx.post(auth_stack.url + path, json=body, headers=bearer(c), timeout=30)
        assert got.status_code == 200 and got.headers["x-ratelimit-limit-requests"] == "10", (path, got.text)
    assert got.headers["x-ratelimit-remaining-requests"] == "8"


def test_a_response_belongs_to_its_key(auth_stack: Stack) -> None:
    """Another key gets 404 for every Responses route, and previous_response_not_found (a 400) naming it in a create,
    as for a response that never existed."""
    r = auth_stack.redis()
    a, _ = tenants.create(r, "resp-a")
    b, _ = tenants.create(r, "resp-b")
    mine = openai.OpenAI(base_url=auth_stack.url + "/v1", api_key=a, max_retries=0)
    theirs = openai.OpenAI(base_url=auth_stack.url + "/v1", api_key=b, max_retries=0)
    model = mine.models.list().data[0].id
    resp = mine.responses.create(model=model, input="Hi", background=True, max_output_tokens=4)
    assert mine.responses.retrieve(resp.id).id == resp.id
    for call in (lambda: theirs.responses.retrieve(resp.id), lambda: theirs.responses.cancel(resp.id),
                 lambda: theirs.responses.delete(resp.id), lambda: theirs.responses.input_items.list(resp.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.BadRequestError) as refused:
        theirs.responses.create(model=model, input="x", previous_response_id=resp.id)
    assert refused.value.code == "previous_response_not_found"
    assert mine.responses.retrieve(resp.id).id == resp.id  # untouched


def test_files_and_batches_belong_to_their_key(auth_stack: Stack) -> None:
    import io

    r = auth_stack.redis()
    a, _ = tenants.create(r, "batch-a")
    b, _ = tenants.create(r, "batch-b")
    mine = openai.OpenAI(base_url=auth_stack.url + "/v1", api_key=a, max_retries=0)
    theirs = openai.OpenAI(base_url=auth_stack.url + "/v1", api_key=b, max_retries=0)
    model = mine.models.list().data[0].id
    line = {"custom_id": "x", "method": "POST", "url": "/v1/completions",
            "body": {"model": model, "prompt": "Hi", "max_tokens": 2}}
    f = mine.files.create(file=("in.jsonl", io.BytesIO(json.dumps(line).encode() + b"\n")), purpose="batch")
    batch = mine.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    for call in (lambda: theirs.files.retrieve(f.id), lambda: theirs.files.content(f.id),
                 lambda: theirs.files.delete(f.id), lambda: theirs.batches.retrieve(batch.id),
                 lambda: theirs.batches.cancel(batch.id),
                 lambda: theirs.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                               completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert [x.id for x in theirs.files.list().data] == [] and theirs.batches.list().data == []
    assert mine.batches.retrieve(batch.id).id == batch.id


def test_open_streams_per_key_are_capped(auth_stack: Stack) -> None:
    r = auth_stack.redis()
    key, _ = tenants.create(r, "streams", max_streams=1)
    with httpx.Client(base_url=auth_stack.url, headers=bearer(key), timeout=60) as c:
        job = c.post("/v1/jobs", json={"prompt": "Count:", "max_tokens": 64, "ignore_eos": True}).json()
        with c.stream("GET", f"/v1/jobs/{job['id']}/events") as first:
            assert first.status_code == 200
            second = c.get(f"/v1/jobs/{job['id']}/events")
            assert second.status_code == 429 and second.headers["retry-after"]
            for ev in iter_sse(first):
                if ev.get("event") == "done":
                    break
        deadline = time.monotonic() + 10  # the slot is given back when the stream ends
        while r.zcard(names.tenant_streams_key("streams")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.get(f"/v1/jobs/{job['id']}/events").status_code == 200


def test_operator_pages_only_on_the_internal_port(auth_stack: Stack) -> None:
    """The operator's pages answer on the internal port only, and it listens on loopback (INTERNAL_HOST) though
    HOST opens the public port to every address: it asks no key."""
    internal = auth_stack.internal_url  # type: ignore[attr-defined]
    [api] = auth_stack.by_role("api")
    listening = {c.laddr.port: c.laddr.ip for c in api.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    assert listening == {auth_stack.port: "0.0.0.0", int(internal.rsplit(":", 1)[1]): "127.0.0.1"}
    for path in ("/metrics", "/scaling", "/docs", "/openapi.json"):
        assert httpx.get(auth_stack.url + path).status_code == 404, path
        assert httpx.get(internal + path).status_code == 200, path
    public = httpx.get(auth_stack.url + "/readyz")
    assert public.status_code == 200 and public.json() == {"status": "ready"}
    assert "workers" in httpx.get(internal + "/readyz").json()
    assert httpx.get(auth_stack.url + "/healthz").status_code == 200
    assert httpx.get(auth_stack.url + "/health").status_code == 200
