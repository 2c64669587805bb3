"""A Redis at its maxmemory (noeviction), or refusing writes for another state of its own: the API refuses new work
with a 503 that says so, stores nothing, and takes work again once Redis does. The API runs in process, on a
redis-server of its own (no workers)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from infra.redis_server import RedisServer
from shared import names
from shared.redis_client import sync_client
from shared.settings import Settings
from tests.helpers import fill, in_process_api

Full = tuple[httpx.AsyncClient, RedisServer]


@pytest.fixture
async def full(tmp_path: Path, model_path: str) -> AsyncIterator[Full]:
    server = RedisServer(tmp_path / "redis", appendonly=False, maxmemory_mb=16)
    server.start()
    try:
        async with in_process_api(Settings(redis_url=server.url, model=model_path)) as client:
            yield client, server
    finally:
        server.stop()


async def test_a_full_store_answers_503_stores_nothing_and_recovers(full: Full) -> None:
    client, server = full
    model = (await client.get("/v1/models")).json()["data"][0]["id"]
    r = sync_client(server.url, decode=False)
    junk = fill(r)
    before = set(r.keys())
    chat = [{"role": "user", "content": "hi"}]
    for path, body in (("/v1/jobs", {"prompt": "hi", "max_tokens": 4}),
                       ("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 4}),
                       ("/v1/messages", {"model": model, "max_tokens": 4, "messages": chat})):
        resp = await client.post(path, json=body)
        # (Anthropic's overloaded status on its route)
        assert resp.status_code == (529 if path == "/v1/messages" else 503), (path, resp.text)
        assert resp.headers["retry-after"] == "10"
        assert "full" in resp.text, resp.text
    assert set(r.keys()) == before  # nothing of them stored
    assert not r.xlen(names.stream(names.JOBS, 0))
    r.delete(*junk)
    resp = await client.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 4})
    assert resp.status_code == 202, resp.text
    r.close()


async def test_a_store_that_refuses_writes_answers_503_and_recovers(full: Full) -> None:
    """Redis refusing writes for a state of its own (here `min-replicas-to-write` with no replica; a failing save
    is `MISCONF`): a submit is a 503 to retry, not an internal error, and nothing is stored."""
    client, server = full
    r = sync_client(server.url, decode=False)
    r.config_set("min-replicas-to-write", 1)
    resp = await client.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 4})
    assert resp.status_code == 503 and resp.headers["retry-after"] == "2", resp.text
    assert not r.xlen(names.stream(names.JOBS, 0))
    r.config_set("min-replicas-to-write", 0)
    resp = await client.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 4})
    assert resp.status_code == 202, resp.text
    r.close()
