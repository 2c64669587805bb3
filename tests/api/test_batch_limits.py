"""The Batch API's per-key limits and ends, through the openai SDK against an API in process with keys required.

The caps run with no workers (on a database of their own: a batch's jobs stay queued, so it stays open; the
test ticks a batch driver itself where a batch must end): stored file bytes (413, given back on delete and on
expiry), lines per batch (400), open batches (429), and `conveyor keys create` sets them. The rest run on the tiny
stack's Redis, whose Celery worker drives the batches and sends the webhooks, and whose workers run the lines: a
batch spends its own token budget, never the key's interactive one, and a small one slows it without failing a
line; a batch past its window expires; an ended batch's event reaches its webhook, signed with the key's secret."""

from __future__ import annotations

import io
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from api.main import create_app
from shared import names, tenants
from shared.redis_client import sync_client
from shared.settings import Settings
from tests.conftest import Stack
from tests.helpers import auntil, conveyor
from tests.webhook_server import webhook_server
from workers.batch_driver import BatchDriver
from workers.webhook import sign

DB = 6  # the worker-less tests' database
WINDOW_S = 6  # the expiring batch's window
LONG = 150  # its lines that cannot all run in the window


@asynccontextmanager
async def sdk(redis_url: str, model: str, key: str, **overrides: Any) -> AsyncIterator[openai.AsyncOpenAI]:
    """The API in process (it drives no batch: the Celery worker does), and the SDK on it with `key`."""
    app = create_app(Settings(redis_url=redis_url, model=model, auth="required", **overrides))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as http:
            yield openai.AsyncOpenAI(base_url="http://test/v1", api_key=key, http_client=http, max_retries=0)


def _jsonl(lines: list[dict[str, Any]]) -> io.BytesIO:
    return io.BytesIO("".join(json.dumps(x) + "\n" for x in lines).encode())


def _lines(model: str, n: int, max_tokens: int = 4, **body: Any) -> list[dict[str, Any]]:
    return [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": model, "prompt": "Hi", "max_tokens": max_tokens, **body}} for i in range(n)]


async def _batch(client: openai.AsyncOpenAI, lines: list[dict[str, Any]], **extra: Any) -> Any:
    f = await client.files.create(file=("in.jsonl", _jsonl(lines)), purpose="batch")
    return await client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h",
                                       extra_body=extra or None)


async def _ended(client: openai.AsyncOpenAI, batch_id: str, timeout: float = 120) -> Any:
    async def ended() -> Any:
        b = await client.batches.retrieve(batch_id)
        return b if b.status in ("completed", "failed", "expired", "cancelled") else None

    return await auntil(f"batch {batch_id} to end", ended, timeout)


def _tenant(r: redis.Redis, prefix: str, **limits: int) -> tuple[str, str, str]:
    """A new key: (name, key, webhook secret)."""
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    key, secret = tenants.create(r, name, **limits)
    return name, key, secret


# --- caps, with no workers ----------------------------------------------------------------------------------

@pytest.fixture
def quiet(redis_server) -> Iterator[tuple[str, redis.Redis]]:  # type: ignore[no-untyped-def]
    url = redis_server.url.rsplit("/", 1)[0] + f"/{DB}"
    r = redis.Redis.from_url(url, decode_responses=True)
    r.flushdb()
    yield url, r
    r.flushdb()
    r.close()


async def test_stored_bytes_are_capped_and_given_back_on_delete(quiet: tuple[str, redis.Redis],
                                                                tiny_model_dir: str) -> None:
    url, r = quiet
    _, key, _ = _tenant(r, "bytes", max_file_bytes=300)
    data = b"x" * 199 + b"\n"
    async with sdk(url, tiny_model_dir, key) as client:
        first = await client.files.create(file=("a.jsonl", io.BytesIO(data)), purpose="batch")
        with pytest.raises(openai.APIStatusError) as refused:
            await client.files.create(file=("b.jsonl", io.BytesIO(data)), purpose="batch")
        assert refused.value.status_code == 413
        assert "max_file_bytes" in refused.value.message and "300" in refused.value.message
        assert [f.id for f in (await client.files.list()).data] == [first.id]  # the refused upload left nothing
        await client.files.delete(first.id)
        second = await client.files.create(file=("b.jsonl", io.BytesIO(data)), purpose="batch")
        assert second.bytes == 200


async def test_stored_bytes_are_given_back_when_files_expire(quiet: tuple[str, redis.Redis],
                                                             tiny_model_dir: str) -> None:
    url, r = quiet
    _, key, _ = _tenant(r, "expiry", max_file_bytes=300)
    data = b"x" * 199 + b"\n"
    async with sdk(url, tiny_model_dir, key, job_ttl_s=1, batch_window_s=1) as client:  # files live 2 s
        first = await client.files.create(file=("a.jsonl", io.BytesIO(data)), purpose="batch")
        with pytest.raises(openai.APIStatusError) as refused:
            await client.files.create(file=("b.jsonl", io.BytesIO(data)), purpose="batch")
        assert refused.value.status_code == 413

        async def gone() -> bool:
            try:
                await client.files.retrieve(first.id)
                return False
            except openai.NotFoundError:
                return True

        await auntil("the first file to expire", gone, timeout=10)
        assert (await client.files.create(file=("b.jsonl", io.BytesIO(data)), purpose="batch")).bytes == 200


async def test_lines_and_open_batches_per_key_are_capped(quiet: tuple[str, redis.Redis], tiny_model_dir: str) -> None:
    url, r = quiet
    _, key, _ = _tenant(r, "caps", max_batch_lines=2, max_open_batches=1)
    driver = BatchDriver(sync_client(url), Settings(redis_url=url, model=tiny_model_dir))
    async with sdk(url, tiny_model_dir, key) as client:
        model = (await client.models.list()).data[0].id
        with pytest.raises(openai.BadRequestError, match="max_batch_lines"):
            await _batch(client, _lines(model, 3))
        first = await _batch(client, _lines(model, 2))
        assert driver.tick() == 1  # its lines submitted; no workers: they stay queued, the batch in progress
        with pytest.raises(openai.RateLimitError, match="max_open_batches"):
            await _batch(client, _lines(model, 1))
        await client.batches.cancel(first.id)

        async def cancelled() -> Any:
            driver.tick()  # the driver a Celery worker would run: it cancels the jobs, then ends the batch
            b = await client.batches.retrieve(first.id)
            return b if b.status == "cancelled" else None

        await auntil("the cancelled batch to end", cancelled, timeout=30)
        second = await _batch(client, _lines(model, 1))  # the cancelled batch no longer counts
        assert second.status == "in_progress"


def test_keys_create_sets_the_batch_limits(quiet: tuple[str, redis.Redis], tmp_path: Path) -> None:
    url, r = quiet
    made = conveyor("keys", "create", "team-b", "--batch-tpm", "7", "--max-file-bytes", "5000",
                    "--max-open-batches", "2", "--max-batch-lines", "9",
                    env={"REDIS_URL": url, "CONVEYOR_CACHE": str(tmp_path)})
    assert made.returncode == 0, made.stderr
    rec = r.hgetall(names.tenant_key("team-b"))
    assert {k: rec[k] for k in ("batch_tpm", "max_file_bytes", "max_open_batches", "max_batch_lines")} == \
           {"batch_tpm": "7", "max_file_bytes": "5000", "max_open_batches": "2", "max_batch_lines": "9"}
    tenants.create(r, "team-c")
    [_, plain] = tenants.list_all(r)
    assert {k: plain[k] for k in tenants.DEFAULT_LIMITS} == tenants.DEFAULT_LIMITS  # not given: the defaults


# --- on the tiny stack ----------------------------------------------------------------------------------------

async def test_a_batch_spends_its_own_budget_not_the_interactive_one(tiny_stack: Stack, tiny_model_dir: str) -> None:
    r = tiny_stack.redis()
    limits = {"rpm": 3, "tpm": 2000}
    name, key, _ = _tenant(r, "budget", **limits)
    _, control, _ = _tenant(r, "control", **limits)
    async with sdk(tiny_stack.redis_url, tiny_model_dir, key) as client:
        model = (await client.models.list()).data[0].id
        batch = await _batch(client, _lines(model, 8))  # more lines than the key's requests per minute
        done = await _ended(client, batch.id, timeout=60)
        assert (done.status, done.request_counts.completed) == ("completed", 8)
        assert not r.exists(names.tenant_bucket_key(name, "requests"), names.tenant_bucket_key(name, "tokens"))
        headers = []
        for c in (client, client.with_options(api_key=control)):  # a key that ran no batch: the same allowance
            raw = await c.completions.with_raw_response.create(model=model, prompt="Hi", max_tokens=4)
            headers.append({k: raw.headers[k] for k in ("x-ratelimit-remaining-requests",
                                                        "x-ratelimit-remaining-tokens")})
        assert headers[0] == headers[1] and headers[0]["x-ratelimit-remaining-requests"] == "2"


async def test_a_small_batch_budget_slows_a_batch_but_fails_no_line(tiny_stack: Stack, tiny_model_dir: str) -> None:
    r = tiny_stack.redis()
    batch_tpm, max_tokens, n = 120, 20, 6
    cost = math.ceil(len("Hi") / 3) + max_tokens  # reserved per line: prompt characters / 3, plus max_tokens
    _, key, _ = _tenant(r, "slow", batch_tpm=batch_tpm)
    _, big_key, _ = _tenant(r, "bigline", batch_tpm=cost // 2)
    async with sdk(tiny_stack.redis_url, tiny_model_dir, key) as client:
        model = (await client.models.list()).data[0].id
        started = time.monotonic()
        batch = await _batch(client, _lines(model, n, max_tokens, ignore_eos=True))
        done = await _ended(client, batch.id, timeout=60)
        took = time.monotonic() - started
        assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", n, 0)
        # the bucket starts full: the lines past it wait for tokens to come back, batch_tpm / 60 a second
        assert took >= (n * cost - batch_tpm) / (batch_tpm / 60) * 0.9, took
        big = await _batch(client.with_options(api_key=big_key), _lines(model, 1, max_tokens))
        done = await _ended(client.with_options(api_key=big_key), big.id, timeout=60)
        assert (done.status, done.request_counts.completed) == ("completed", 1)  # a line over the whole budget waits


async def test_a_batch_past_its_window_expires(tiny_stack: Stack, tiny_model_dir: str) -> None:
    r = tiny_stack.redis()
    name, key, secret = _tenant(r, "expires")
    with webhook_server() as hooks:
        async with sdk(tiny_stack.redis_url, tiny_model_dir, key, batch_window_s=WINDOW_S) as client:
            model = (await client.models.list()).data[0].id
            short = [{**x, "custom_id": f"short-{i}"} for i, x in enumerate(_lines(model, 2, max_tokens=2))]
            lines = short + _lines(model, LONG, max_tokens=1000, ignore_eos=True)  # far more than runs in the window
            batch = await _batch(client, lines, webhook_url=hooks.url)
            assert batch.expires_at - batch.created_at == WINDOW_S
            done = await _ended(client, batch.id, timeout=60)
            assert done.status == "expired" and done.expired_at and done.expired_at >= done.expires_at - 1
            counts = done.request_counts
            assert counts.total == len(lines) and counts.completed + counts.failed == len(lines)
            assert 1 <= counts.completed < LONG
            out = [json.loads(x) for x in (await client.files.content(done.output_file_id)).text.splitlines()]
            err = [json.loads(x) for x in (await client.files.content(done.error_file_id)).text.splitlines()]
            assert len(out) == counts.completed and all(o["response"]["status_code"] == 200 for o in out)
            assert len(err) == counts.failed and {e["error"]["code"] for e in err} == {"batch_expired"}
            assert {o["custom_id"] for o in out} | {e["custom_id"] for e in err} == {x["custom_id"] for x in lines}

            async def idle() -> bool:  # the lines that were running were cancelled: none of the key's jobs is left
                return int(r.get(names.tenant_active_key(name)) or 0) == 0

            await auntil("the expired batch's jobs to end", idle, timeout=30)
        received = hooks.wait_for(1, timeout=60)
    # at least once (README, the Batch API): a driver that stops between announcing the end and noting it announces
    # it again; a repeat is the same event, signed alike
    assert received and len({event["id"] for _, event, _ in received}) == 1
    for headers, event, raw in received:
        assert event["type"] == "batch.expired" and event["data"] == {"id": batch.id}
        assert headers["x-conveyor-signature"] == sign(raw, secret, headers["x-conveyor-timestamp"])


async def test_an_ended_batch_calls_its_webhook_signed(tiny_stack: Stack, tiny_model_dir: str) -> None:
    r = tiny_stack.redis()
    _, key, secret = _tenant(r, "hooks")
    with webhook_server() as hooks:
        async with sdk(tiny_stack.redis_url, tiny_model_dir, key) as client:
            model = (await client.models.list()).data[0].id
            good = await _batch(client, _lines(model, 2), webhook_url=hooks.url)
            bad = await _batch(client, _lines(model, 2, temperature=7), webhook_url=hooks.url)  # every line refused
            quiet = await _batch(client, _lines(model, 1))  # no webhook: no call
            assert (await _ended(client, good.id)).status == "completed"
            failed = await _ended(client, bad.id)
            assert failed.status == "failed" and failed.failed_at and failed.errors.data[0].code
            await _ended(client, quiet.id)
            with pytest.raises(openai.BadRequestError):
                await _batch(client, _lines(model, 1), webhook_url="ftp://example.com/hook")
        received = hooks.wait_for(2, timeout=60)
    events = {body["data"]["id"]: (headers, body, raw) for headers, body, raw in received}
    assert set(events) == {good.id, bad.id}
    for batch_id, kind in ((good.id, "batch.completed"), (bad.id, "batch.failed")):
        headers, body, raw = events[batch_id]
        assert body["object"] == "event" and body["type"] == kind and body["id"].startswith("evt_")
        assert isinstance(body["created_at"], int) and body["data"] == {"id": batch_id}
        assert headers["x-conveyor-batch"] == batch_id
        assert headers["x-conveyor-signature"] == sign(raw, secret, headers["x-conveyor-timestamp"])
