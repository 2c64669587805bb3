"""The batch driver (workers/batch_driver.py) on a real Redis, one tick at a time: batches are made through the
API in process (its Files and Batch routes; it drives nothing), and the test plays the inference pool, ending
the jobs the driver submits. A batch runs every line once, WINDOW at a time; a driver that stops midway (its
lease unrenewed, its last submits unnoted) hands over and nothing runs twice, one that stops cleanly hands over at
once; a damaged job record fails its line and the batch goes on; cancelling keeps the finished lines; a batch past
its window expires."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import redis

from infra.redis_server import RedisServer
from shared import names, tenants
from shared.job_ops import JobOps
from shared.jobs import FinishReason
from shared.redis_client import sync_client
from shared.settings import Settings
from tests.helpers import in_process_api, until
from workers.batch_driver import CANCEL_WAIT_S, LEASE_MS, WINDOW, BatchDriver

DB = 8  # this module's database, emptied around each test


@pytest.fixture
def settings(redis_server: RedisServer, model_path: str) -> Iterator[Settings]:
    url = redis_server.url.rsplit("/", 1)[0] + f"/{DB}"
    r = redis.Redis.from_url(url)
    r.flushdb()
    yield Settings(redis_url=url, model=model_path)
    r.flushdb()
    r.close()


@pytest.fixture
def r(settings: Settings) -> Iterator[redis.Redis]:
    client = sync_client(settings.redis_url)
    yield client
    client.close()


@pytest.fixture
async def api(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    async with in_process_api(settings) as client:
        yield client


def _lines(n: int, url: str = "/v1/chat/completions") -> bytes:
    def body(i: int) -> dict[str, Any]:
        if url == "/v1/completions":
            return {"prompt": f"Count to {i}:", "max_tokens": 4}
        return {"messages": [{"role": "user", "content": f"Say {i}."}], "max_tokens": 4}

    return "".join(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body(i)}) + "\n"
                   for i in range(n)).encode()


async def _batch(api: httpx.AsyncClient, n: int, url: str = "/v1/chat/completions", **extra: Any) -> str:
    up = await api.post("/v1/files", files={"file": ("in.jsonl", _lines(n, url))}, data={"purpose": "batch"})
    assert up.status_code == 200, up.text
    made = await api.post("/v1/batches", json={"input_file_id": up.json()["id"], "endpoint": url,
                                              "completion_window": "24h", **extra})
    assert made.status_code == 200, made.text
    return str(made.json()["id"])


def _inflight(r: redis.Redis, batch_id: str) -> dict[str, str]:
    return r.hgetall(names.batch_key(batch_id, "inflight"))  # type: ignore[return-value]


def _end(r: redis.Redis, settings: Settings, job_ids: list[str], reason: FinishReason = FinishReason.stop) -> None:
    """What an inference worker does at the end of each job: its text, then its end (finish.lua)."""
    ops = JobOps(r, settings.job_ttl_s)
    for job_id in job_ids:
        r.set(names.text_key(job_id), f"text of {job_id}")
        ops.finish(job_id, reason, fields={"prompt_tokens": 5, "completion_tokens": 2})


def _jobs_submitted(r: redis.Redis) -> int:
    return sum(int(r.xlen(s)) for s in names.streams(names.JOBS))


def _run_out(driver: BatchDriver, r: redis.Redis, settings: Settings, batch_id: str, ticks: int = 50) -> dict[str, str]:
    """Tick, ending every job in flight, until the batch ends; its record."""
    for _ in range(ticks):
        driver.tick()
        rec: dict[str, str] = r.hgetall(names.batch_key(batch_id))  # type: ignore[assignment]
        if rec["status"] in ("completed", "failed", "cancelled", "expired"):
            return rec
        assert len(_inflight(r, batch_id)) <= WINDOW
        _end(r, settings, list(_inflight(r, batch_id).values()))
    raise AssertionError(f"batch {batch_id} did not end in {ticks} ticks: {rec}")


async def _file(api: httpx.AsyncClient, file_id: str) -> list[dict[str, Any]]:
    got = await api.get(f"/v1/files/{file_id}/content")
    assert got.status_code == 200, got.text
    return [json.loads(x) for x in got.text.splitlines()]


async def test_a_batch_runs_every_line_once_a_window_at_a_time(api: httpx.AsyncClient, r: redis.Redis,
                                                               settings: Settings) -> None:
    n = 2 * WINDOW + 10
    batch_id = await _batch(api, n)
    driver = BatchDriver(r, settings)
    driver.tick()
    inflight = _inflight(r, batch_id)
    assert len(inflight) == WINDOW and _jobs_submitted(r) == WINDOW
    job = r.hgetall(names.job_key(inflight["0"]))
    assert job["batch"] == batch_id and job["status"] == "queued"
    assert r.exists(names.idempotency_key("", f"{batch_id}:0"))  # the line's key names its job
    rec = _run_out(driver, r, settings, batch_id)
    assert (rec["status"], rec["completed"], rec["failed"]) == ("completed", str(n), "0")
    assert _jobs_submitted(r) == n
    out = await _file(api, rec["output_file_id"])
    assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(n))
    body = out[0]["response"]["body"]
    assert list(body) == ["id", "object", "created", "model", "choices", "usage", "system_fingerprint"]
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-" + out[0]["response"]["request_id"][4:]
    assert body["choices"][0]["message"]["content"].startswith("text of job_")
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    polled = await api.get(f"/v1/batches/{batch_id}")
    assert polled.json()["status"] == "completed" and not r.sismember(names.BATCHES_ACTIVE, batch_id)


async def test_a_stopped_driver_hands_over_and_nothing_runs_twice(api: httpx.AsyncClient, r: redis.Redis,
                                                                  settings: Settings) -> None:
    n = WINDOW + 36
    batch_id = await _batch(api, n, "/v1/completions")
    first, second = BatchDriver(r, settings, "first"), BatchDriver(r, settings, "second")
    assert first.tick() == 1
    before = _inflight(r, batch_id)
    # `first` is killed having submitted lines 60-63 but before it noted them: their jobs stand, the batch's
    # record does not name them
    r.hset(names.batch_key(batch_id), "next", WINDOW - 4)
    r.hdel(names.batch_key(batch_id, "inflight"), *[str(i) for i in range(WINDOW - 4, WINDOW)])
    assert second.tick() == 0  # the lease is still the first's
    until("the first driver's lease to lapse", lambda: not r.exists(names.batch_key(batch_id, "lease")),
          timeout=LEASE_MS / 1000 + 5, every=0.1)
    assert second.tick() == 1
    assert _inflight(r, batch_id) == before and _jobs_submitted(r) == WINDOW  # the same jobs: none twice
    assert first.tick() == 0  # back from the dead, it finds the lease taken
    rec = _run_out(second, r, settings, batch_id)
    assert (rec["status"], rec["completed"], rec["failed"]) == ("completed", str(n), "0")
    assert _jobs_submitted(r) == n
    out = await _file(api, rec["output_file_id"])
    assert len(out) == n and len({o["custom_id"] for o in out}) == n
    assert all(o["response"]["body"]["object"] == "text_completion" for o in out)


async def test_a_driver_that_stops_cleanly_hands_over_at_once(api: httpx.AsyncClient, r: redis.Redis,
                                                               settings: Settings) -> None:
    batch_id = await _batch(api, 3)
    first, second = BatchDriver(r, settings, "first"), BatchDriver(r, settings, "second")
    assert first.tick() == 1 and second.tick() == 0
    second.release()  # holds nothing: takes nothing away
    assert r.get(names.batch_key(batch_id, "lease")) == "first"
    first.release()  # a warm shutdown
    assert second.tick() == 1


async def test_a_damaged_job_record_fails_its_line_and_the_batch_goes_on(api: httpx.AsyncClient, r: redis.Redis,
                                                                         settings: Settings) -> None:
    batch_id = await _batch(api, 4)
    driver = BatchDriver(r, settings)
    driver.tick()
    inflight = _inflight(r, batch_id)
    r.delete(names.job_key(inflight["1"]))  # what a finish wrote into a hash a failover had emptied
    r.hset(names.job_key(inflight["1"]), mapping={"status": "succeeded", "finish_reason": "stop", "seq": "1"})
    r.hset(names.job_key(inflight["2"]), "status", "zombie")  # a status no job has
    _end(r, settings, [inflight["0"], inflight["3"]])
    rec = _run_out(driver, r, settings, batch_id, ticks=3)
    assert (rec["status"], rec["completed"], rec["failed"]) == ("completed", "2", "2")
    errors = {e["custom_id"]: e["error"] for e in await _file(api, rec["error_file_id"])}
    assert set(errors) == {"req-1", "req-2"}
    assert all(e["code"] == "generation_failed" and "record is incomplete" in e["message"] for e in errors.values())


async def test_a_cancelled_batch_keeps_its_finished_lines(api: httpx.AsyncClient, r: redis.Redis,
                                                          settings: Settings) -> None:
    n = WINDOW + 20
    batch_id = await _batch(api, n)
    driver = BatchDriver(r, settings)
    driver.tick()
    inflight = _inflight(r, batch_id)
    _end(r, settings, [inflight[str(i)] for i in range(5)])
    cancelled = await api.post(f"/v1/batches/{batch_id}/cancel")
    assert cancelled.json()["status"] == "cancelling"
    rec = _run_out(driver, r, settings, batch_id, ticks=3)
    # every line is in a file: those never submitted end in the error file too, so the counts add up to the total
    assert (rec["status"], rec["completed"], rec["failed"]) == ("cancelled", "5", str(n - 5))
    assert all(r.hget(names.job_key(j), "status") == "cancelled" for j in list(inflight.values())[5:])
    assert _jobs_submitted(r) == WINDOW  # nothing submitted once cancelling
    assert len(await _file(api, rec["output_file_id"])) == 5
    errors = await _file(api, rec["error_file_id"])
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"} and len(errors) == n - 5
    assert sorted(e["custom_id"] for e in errors) == sorted(f"req-{i}" for i in range(5, n))


async def test_a_batch_past_its_window_expires_and_is_announced(r: redis.Redis, settings: Settings) -> None:
    short = settings.model_copy(update={"batch_window_s": 2})
    async with in_process_api(short) as api:
        n = WINDOW + 6
        batch_id = await _batch(api, n, webhook_url="https://example.com/hook")
        driver = BatchDriver(r, short)
        driver.tick()
        _end(r, short, list(_inflight(r, batch_id).values())[:3])
        expires_at = float(r.hget(names.batch_key(batch_id), "expires_at") or 0)
        until("the batch's window to pass", lambda: time.time() >= expires_at, timeout=10, every=0.1)
        rec = _run_out(driver, r, short, batch_id, ticks=2)
        assert (rec["status"], rec["completed"], rec["failed"]) == ("expired", "3", str(n - 3))
        errors = await _file(api, rec["error_file_id"])
        assert len(errors) == n - 3 and {e["error"]["code"] for e in errors} == {"batch_expired"}
        assert {e["custom_id"] for e in errors} | {o["custom_id"] for o in await _file(api, rec["output_file_id"])} \
            == {f"req-{i}" for i in range(n)}
        ended = [f for s in names.streams(names.ENDED) for _, f in r.xrange(s)]
        assert {"batch_id": batch_id} in ended  # for the after-job drain, which calls the webhook
        assert not r.zscore(names.batches_open(""), batch_id)


async def test_batch_lines_take_neither_the_keys_unfinished_jobs_nor_the_services_queue(r: redis.Redis,
                                                                                      settings: Settings) -> None:
    """A key's batch lines in flight count neither against its max_queued nor against the service's queue cap
    (MAX_QUEUED): they wait behind every interactive job, at the lowest priority, so the key's own interactive
    requests and other keys' are still accepted while its batches run; the counts stay right as the lines end."""
    s = settings.model_copy(update={"auth": "required", "max_queued": 8})
    key, _ = tenants.create(r, "team", max_queued=4)
    other, _ = tenants.create(r, "other")
    async with in_process_api(s) as api:
        api.headers["Authorization"] = f"Bearer {key}"
        batch_id = await _batch(api, WINDOW + 6)
        driver = BatchDriver(r, s)
        driver.tick()
        assert len(_inflight(r, batch_id)) == WINDOW  # past the key's max_queued (4) and MAX_QUEUED (8)
        for who in (key, other):
            got = await api.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 2},
                                 headers={"Authorization": f"Bearer {who}"})
            assert got.status_code == 202, got.text
        assert r.get(names.tenant_active_key("team")) == "1"  # its interactive job alone
        depth = sum(int(r.get(names.submitted_counter(p)) or 0) - int(r.get(names.dequeued_counter(p)) or 0)
                    for p in names.partitions())
        assert depth == 2  # the two interactive jobs
        rec = _run_out(driver, r, s, batch_id)
        assert rec["status"] == "completed"
        assert r.get(names.tenant_active_key("team")) == "1" and depth == sum(
            int(r.get(names.submitted_counter(p)) or 0) - int(r.get(names.dequeued_counter(p)) or 0)
            for p in names.partitions())


async def test_an_ended_batch_keeps_only_its_results_and_a_deleted_result_file_frees_them(
        api: httpx.AsyncClient, r: redis.Redis, settings: Settings) -> None:
    """Once a batch ends its copy of the input lines goes (the input file is the client's to keep or delete);
    deleting its output file deletes the results it was made of, not only the file's record."""
    batch_id = await _batch(api, 3)
    assert r.exists(names.batch_key(batch_id, "lines"))
    rec = _run_out(BatchDriver(r, settings), r, settings, batch_id)
    assert not r.exists(names.batch_key(batch_id, "lines"))
    assert r.hlen(names.batch_key(batch_id, "out")) == 3
    gone = await api.delete(f"/v1/files/{rec['output_file_id']}")
    assert gone.status_code == 200 and gone.json()["deleted"] is True
    assert not r.exists(names.batch_key(batch_id, "out"))


async def test_a_batch_being_made_holds_its_lines_and_its_open_place_briefly(
        r: redis.Redis, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """An API process killed while it checks a big input file leaves what it wrote so far to expire soon (not the
    batch's 48 h), and the key's open place it took ends soon too; a batch made holds them for its window."""
    from api import batches

    s = settings.model_copy(update={"auth": "required"})
    key, _ = tenants.create(r, "team", max_open_batches=2)
    seen: list[tuple[int, float]] = []
    parse = batches.parse_line

    def checked(*args: Any) -> Any:
        lines = [k for k in r.scan_iter(match=names.batch_key("*", "lines")) if not k.endswith("inflight")]
        if lines:
            [(_, score)] = r.zrange(names.batches_open("team"), 0, -1, withscores=True)
            seen.append((int(r.ttl(lines[0])), score - time.time()))
        return parse(*args)

    monkeypatch.setattr(batches, "parse_line", checked)
    async with in_process_api(s) as api:
        api.headers["Authorization"] = f"Bearer {key}"
        batch_id = await _batch(api, 1_200)  # flushed every 500 lines
        assert seen and all(0 < ttl <= batches.CREATING_S and left <= batches.CREATING_S for ttl, left in seen)
        assert r.ttl(names.batch_key(batch_id, "lines")) > settings.batch_window_s
        [(_, score)] = r.zrange(names.batches_open("team"), 0, -1, withscores=True)
        assert score > time.time() + settings.batch_window_s - 60


async def test_a_cancelled_batch_whose_jobs_never_stop_ends_after_the_wait(api: httpx.AsyncClient, r: redis.Redis,
                                                                          settings: Settings) -> None:
    """A line's job that no engine stops (its engine died, none of its model runs): the cancelled batch waits
    CANCEL_WAIT_S for it, then ends `cancelled` with that line in the error file, not `cancelling` for good."""
    batch_id = await _batch(api, 3)
    driver = BatchDriver(r, settings)
    driver.tick()
    inflight = _inflight(r, batch_id)
    ops = JobOps(r, settings.job_ttl_s)
    for job_id in inflight.values():
        assert ops.start(job_id, "a-worker-gone").code.value == 1  # running, on an engine that is gone
    _end(r, settings, [inflight["0"]])
    assert (await api.post(f"/v1/batches/{batch_id}/cancel")).json()["status"] == "cancelling"
    for _ in range(3):
        driver.tick()
    assert r.hget(names.batch_key(batch_id), "status") == "cancelling"  # waits for its running jobs to stop
    r.hset(names.batch_key(batch_id), "cancelling_at", time.time() - CANCEL_WAIT_S - 1)
    driver.tick()
    rec = r.hgetall(names.batch_key(batch_id))
    assert (rec["status"], rec["completed"], rec["failed"]) == ("cancelled", "1", "2")
    errors = await _file(api, rec["error_file_id"])
    assert sorted(e["custom_id"] for e in errors) == ["req-1", "req-2"]
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}


async def test_a_long_step_keeps_its_lease(api: httpx.AsyncClient, r: redis.Redis, settings: Settings,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A big batch's expiry takes seconds, past LEASE_MS: the driver renews its lease as it goes, so another
    driver does not take the batch over and run the same step beside it (announcing the batch twice)."""
    from shared import scripts
    from workers import batch_driver

    monkeypatch.setattr(batch_driver, "LEASE_MS", 400)
    batch_id = await _batch(api, 1_200)  # expired in three parts of at most 500 lines
    r.hset(names.batch_key(batch_id), "expires_at", time.time() - 1)
    a, b = BatchDriver(r, settings), BatchDriver(r, settings)
    execute, calls, beside = scripts.execute, [], []

    def slow(pipe: Any, *args: Any) -> Any:
        calls.append(1)
        if len(calls) <= 3:  # a's parts, each 250 ms: the lease taken at the tick's start would run out by the 2nd
            time.sleep(0.25)
            if len(calls) == 2:
                beside.append(b.tick())
        return execute(pipe, *args)

    monkeypatch.setattr(scripts, "execute", slow)
    assert a.tick() == 1
    assert beside == [0]  # b found the lease held
    rec = r.hgetall(names.batch_key(batch_id))
    assert (rec["status"], rec["failed"]) == ("expired", "1200")


async def test_a_run_gives_up_its_leases_for_the_next_run_wherever_it_lands(api: httpx.AsyncClient, r: redis.Redis,
                                                                           settings: Settings) -> None:
    """A Celery run (the drain and the driver beside it) ends by giving up its batches' leases: the next run may land
    in another prefork child, whose driver takes the batch at its first tick rather than LEASE_MS later."""
    from workers.after_job import AfterJob
    from workers.celery_app import run_lanes

    batch_id = await _batch(api, 3)
    first, second = BatchDriver(r, settings), BatchDriver(r, settings)
    after = AfterJob(r, settings, consumer="after-lanes")
    try:
        assert run_lanes(after, first, budget_s=0.3, wait_ms=100)["batch_ticks"] >= 1
        assert len(_inflight(r, batch_id)) == 3 and not r.exists(names.batch_key(batch_id, "lease"))
        assert second.tick() == 1  # at once
    finally:
        after.close()


async def test_a_batch_of_a_revoked_key_is_cancelled_not_left_running_to_its_window(r: redis.Redis,
                                                                                   settings: Settings) -> None:
    """A key revoked while its batch runs: its lines are refused for good, so the batch ends `cancelled` (its
    finished lines kept) rather than staying in progress, retried every tick, until it expires a day later."""
    s = settings.model_copy(update={"auth": "required"})
    key, _ = tenants.create(r, "gone")
    async with in_process_api(s) as api:
        api.headers["Authorization"] = f"Bearer {key}"
        batch_id = await _batch(api, WINDOW + 4)
        driver = BatchDriver(r, s)
        driver.tick()
        tenants.revoke(r, "gone")
        rec = _run_out(driver, r, s, batch_id, ticks=5)
    assert (rec["status"], rec["completed"]) == ("cancelled", str(WINDOW))


async def test_a_byte_order_mark_and_blank_lines_are_read_as_an_editor_shows_them(api: httpx.AsyncClient,
                                                                                   r: redis.Redis) -> None:
    """A file saved with a UTF-8 byte-order mark (Windows tools) has its first line taken; an error names the line
    by its number in the file, blank lines counted."""
    first, second = _lines(2).decode().splitlines()
    data = ("\ufeff" + first + "\n\n" + second + "\n" + first + "\n").encode()  # line 4 repeats line 1's custom_id
    up = await api.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"})
    made = await api.post("/v1/batches", json={"input_file_id": up.json()["id"], "endpoint": "/v1/chat/completions",
                                               "completion_window": "24h"})
    assert made.status_code == 200, made.text
    batch_id = made.json()["id"]
    assert made.json()["request_counts"]["total"] == 3
    assert r.hlen(names.batch_key(batch_id, "lines")) == 2
    [err] = [json.loads(v) for v in r.hvals(names.batch_key(batch_id, "err"))]
    assert err["custom_id"] == "req-0" and err["error"]["message"].startswith("line 4: "), err


async def test_an_input_file_without_a_request_is_refused(api: httpx.AsyncClient) -> None:
    up = await api.post("/v1/files", files={"file": ("in.jsonl", b"\n  \n")}, data={"purpose": "batch"})
    made = await api.post("/v1/batches", json={"input_file_id": up.json()["id"], "endpoint": "/v1/chat/completions",
                                               "completion_window": "24h"})
    assert made.status_code == 400 and made.json()["error"]["code"] == "empty_file", made.text
    listed = (await api.get("/v1/batches", params={"limit": 100})).json()["data"]
    assert all(b["input_file_id"] != up.json()["id"] for b in listed)  # nothing of it stays
