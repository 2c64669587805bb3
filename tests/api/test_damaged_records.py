"""A job record that is only part of one (a Redis failover can leave one: a later write landing in a hash the
failover had emptied) answers a clear 404 everywhere a job is read, never a 500; a stream whose job's record
is damaged under it ends with an error event, as for an expired job.

The API runs in process against the session's real Redis (db 15, flushed around each test; no workers); the
damaged records are written into it directly."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

import httpx
import orjson
import pytest
import redis

from api.main import create_app
from infra.redis_server import RedisServer
from shared import names
from shared.jobs import DamagedRecord, Job
from shared.settings import Settings


@pytest.fixture
async def api(redis_server: RedisServer, redis_db: redis.Redis, model_path: str) -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(redis_url=redis_server.url.rsplit("/", 1)[0] + "/15", model=model_path)  # redis_db's
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
            yield client


def _whole(job_id: str) -> dict[str, str]:
    return {"id": job_id, "status": "queued", "model": "m", "request": "{}", "created_at": repr(time.time()),
            "seq": "0", "ordinal": "1"}


DAMAGED = {
    # what a finish wrote into a hash a failover had emptied: no submission fields at all
    "finish-into-empty": lambda j: {"status": "cancelled", "finish_reason": "cancelled", "finished_at": "1.5",
                                    "seq": "1"},
    "step-into-empty": lambda j: {"seq": "7", "completion_tokens": "7"},
    "no-id": lambda j: {k: v for k, v in _whole(j).items() if k != "id"},
    "no-status": lambda j: {k: v for k, v in _whole(j).items() if k != "status"},
    "no-created-at": lambda j: {k: v for k, v in _whole(j).items() if k != "created_at"},
    "created-at-not-a-number": lambda j: {**_whole(j), "created_at": "yesterday"},
    "tokens-not-a-number": lambda j: {**_whole(j), "status": "running", "prompt_tokens": "many"},
    "unknown-status": lambda j: {**_whole(j), "status": "zombie"},
    "unknown-finish-reason": lambda j: {**_whole(j), "status": "succeeded", "finish_reason": "tired"},
}


def _job_id() -> str:
    return names.job_id_in(names.new_job_partition(""), uuid.uuid4().hex)


def _is_incomplete(r: httpx.Response, job_id: str) -> None:
    assert r.status_code == 404, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"type", "message", "param", "code"}, body
    assert body["error"]["type"] == "not_found_error" and body["error"]["code"] == "incomplete_record"
    assert job_id in body["error"]["message"] and "incomplete record" in body["error"]["message"]
    assert r.headers.get("x-request-id")


@pytest.mark.parametrize("damage", DAMAGED)
async def test_every_read_of_a_damaged_record_is_a_clear_404(api: httpx.AsyncClient, redis_db: redis.Redis,
                                                            damage: str) -> None:
    job_id = _job_id()
    redis_db.hset(names.job_key(job_id), mapping=DAMAGED[damage](job_id))
    _is_incomplete(await api.get(f"/v1/jobs/{job_id}"), job_id)
    _is_incomplete(await api.get(f"/v1/jobs/{job_id}/events"), job_id)
    _is_incomplete(await api.post(f"/v1/jobs/{job_id}/cancel"), job_id)
    resp_id = "resp_" + job_id.removeprefix("job_")
    _is_incomplete(await api.get(f"/v1/responses/{resp_id}"), job_id)
    _is_incomplete(await api.get(f"/v1/responses/{resp_id}", params={"stream": "true"}), job_id)
    r = await api.post("/v1/responses", json={"model": "SmolLM2-135M-Instruct", "input": "hi",
                                              "previous_response_id": resp_id})
    _is_incomplete(r, job_id)


@pytest.mark.parametrize("key", ["record", "events", "text"])
async def test_a_jobs_key_of_another_type_is_a_clear_404(api: httpx.AsyncClient, redis_db: redis.Redis,
                                                         key: str) -> None:
    """A job's key written over by something of another type (by hand, or by another program) is a damaged
    record too: every read that meets it answers the same 404 (a stream ends as an expired job's), never a 500
    (Redis's WRONGTYPE)."""
    job_id = _job_id()
    redis_db.hset(names.job_key(job_id), mapping={**_whole(job_id), "status": "succeeded", "finish_reason": "stop",
                                                  "seq": "1", "finished_at": repr(time.time())})
    damaged = {"record": names.job_key(job_id), "events": names.events_key(job_id), "text": names.text_key(job_id)}
    redis_db.delete(damaged[key])
    redis_db.sadd(damaged[key], "not-a-job")
    resp_id = "resp_" + job_id.removeprefix("job_")
    reads = [await api.get(f"/v1/jobs/{job_id}"), await api.get(f"/v1/jobs/{job_id}/events"),
             await api.post(f"/v1/jobs/{job_id}/cancel"), await api.get(f"/v1/responses/{resp_id}")]
    if key == "events":  # the record reads whole; the job's events end as an expired job's
        assert [r.status_code for r in reads[:3]] == [200, 200, 409]
        assert reads[1].text.startswith("event: error") and "the job expired" in reads[1].text
    else:
        for r in reads:
            _is_incomplete(r, job_id)


async def test_a_whole_record_still_reads(api: httpx.AsyncClient, redis_db: redis.Redis) -> None:
    job_id = _job_id()
    redis_db.hset(names.job_key(job_id), mapping=_whole(job_id))
    r = await api.get(f"/v1/jobs/{job_id}")
    assert r.status_code == 200 and r.json()["status"] == "queued", r.text
    assert (await api.get(f"/v1/jobs/{_job_id()}")).json()["error"]["code"] is None  # absent: the plain 404


def test_from_record_names_what_is_wrong() -> None:
    with pytest.raises(DamagedRecord, match="missing id, created_at"):
        Job.from_record({"status": "succeeded", "seq": "3"}, "job_x")
    with pytest.raises(DamagedRecord, match="job_x.*zombie"):
        Job.from_record({"id": "job_x", "status": "zombie", "created_at": "1.0"})


async def _damage_later(redis_db: redis.Redis, delay: float = 0.3) -> str:
    """After `delay`, the one job record in the database loses its created_at; returns its job id."""
    await asyncio.sleep(delay)
    deadline = time.monotonic() + 10
    while not (keys := redis_db.keys("*:job:job_*")):
        assert time.monotonic() < deadline, "no job was stored"
        await asyncio.sleep(0.05)
    [key] = keys
    redis_db.hdel(key, "created_at")
    return str(key).rsplit(":", 1)[1]


def _events(raw: str) -> list[dict[str, str]]:
    out = []
    for block in raw.replace("\r\n", "\n").split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line and not line.startswith(":"))
        if fields:
            out.append(fields)
    return out


async def test_a_job_stream_whose_record_is_damaged_under_it_ends_with_an_error(
        api: httpx.AsyncClient, redis_db: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    job_id = _job_id()
    redis_db.hset(names.job_key(job_id), mapping=_whole(job_id))
    with caplog.at_level(logging.ERROR):
        damaged = asyncio.create_task(_damage_later(redis_db))
        r = await api.get(f"/v1/jobs/{job_id}/events")  # queued, nobody runs it: status, then the re-read
        assert await damaged == job_id
    assert r.status_code == 200
    events = _events(r.text)
    assert events[0]["event"] == "status" and events[-1]["event"] == "error", events
    assert orjson.loads(events[-1]["data"])["error"]["type"] == "not_found_error"
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR], caplog.records
    _is_incomplete(await api.get(f"/v1/jobs/{job_id}"), job_id)


async def test_an_openai_stream_whose_record_is_damaged_under_it_ends_with_an_error(
        api: httpx.AsyncClient, redis_db: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    """The stream ends with an error object (no [DONE]) and its cleanup (cancelling the job) raises nothing."""
    with caplog.at_level(logging.ERROR):
        damaged = asyncio.create_task(_damage_later(redis_db))
        r = await asyncio.wait_for(api.post("/v1/completions", json={  # it once waited forever
            "model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": 4, "stream": True}), 30)
        job_id = await damaged
    assert r.status_code == 200, r.text
    events = _events(r.text)
    assert "error" in orjson.loads(events[-1]["data"]) and "[DONE]" not in r.text, events
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR], caplog.records
    _is_incomplete(await api.get(f"/v1/jobs/{job_id}"), job_id)
