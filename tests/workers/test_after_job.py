"""After-job work on a real Redis, with a real HTTP receiver: every ended job is accounted once,
its webhook gets the job as polled, a failing webhook is retried and finally dead-lettered."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from infra.redis_server import RedisServer
from shared import names
from shared.job_ops import JobOps
from shared.jobs import FinishReason, Job, JobStatus, new_record
from shared.redis_client import sync_client, text
from shared.settings import Settings
from tests.helpers import blocked_on, until
from tests.webhook_server import webhook_server
from workers.after_job import OUTSTANDING_PER_THREAD, AfterJob
from workers.webhook import sign


def end_job(r: redis.Redis, job_id: str, webhook_url: str | None = None, text: str = "Paris.",
            owner: str | None = None) -> None:
    record = new_record(job_id, "m", "") | {"status": JobStatus.running.value, "prompt_tokens": 7}
    record.pop("request")  # the API keeps the request on the jobs stream only
    if webhook_url:
        record["webhook_url"] = webhook_url  # as the API stores it
    if owner is not None:
        record["owner"] = owner  # the tenant whose API key submitted it ('' with auth off)
    r.hset(names.job_key(job_id), mapping=record)
    r.set(names.text_key(job_id), text)
    JobOps(r, 3600).finish(job_id, FinishReason.stop, fields={"completion_tokens": 3})


def after(r: redis.Redis, **settings: Any) -> AfterJob:
    """An after-job worker; its webhooks may reach the receivers of these tests, on loopback."""
    defaults: dict[str, Any] = {"webhook_retry_s": 0, "webhook_attempts": 3, "webhook_allow_private": True}
    return AfterJob(r, Settings(**(defaults | settings)), consumer="after-test")


def test_every_end_is_accounted_once(redis_db: redis.Redis) -> None:
    """A job's tokens count in its day's usage with its end (finish.lua), not when a drain comes by: a record
    that expires first (no Celery worker for a day), an `ended` entry trimmed or lost in a failover, a drain
    past midnight, each counted once all the same; a delivery seen twice counts nothing more."""
    worker = after(redis_db)
    end_job(redis_db, "job_a")
    end_job(redis_db, "job_b")
    assert redis_db.hgetall(names.usage_key()) == {"m:prompt_tokens": "14", "m:completion_tokens": "6", "m:jobs": "2"}
    redis_db.delete(names.job_key("job_b"))  # expired before any drain: counted already
    assert worker.drain() == {"done": 2, "failed": 0, "dead": 0}
    assert redis_db.hgetall(names.usage_key()) == {"m:prompt_tokens": "14", "m:completion_tokens": "6", "m:jobs": "2"}
    assert worker.drain() == {"done": 0, "failed": 0, "dead": 0}
    redis_db.xadd(names.stream(names.ENDED, 0), {"job_id": "job_a"})  # delivered twice: still counted once
    assert worker.drain()["done"] == 1
    assert redis_db.hget(names.usage_key(), "m:jobs") == "2"
    assert 0 < redis_db.ttl(names.usage_key()) <= 35 * 86400
    redis_db.xadd(names.stream(names.ENDED, 0), {"job_id": "job_expired"})  # its record is gone: nothing to do
    assert worker.drain()["done"] == 1 and not redis_db.exists(names.job_key("job_expired"))


def test_webhook_gets_the_polled_job_signed(redis_db: redis.Redis) -> None:
    worker = after(redis_db, webhook_secret="s3cret")
    with webhook_server() as hooks:
        end_job(redis_db, "job_hook", hooks.url)
        end_job(redis_db, "job_quiet")  # no webhook asked for: accounted, no call
        assert worker.drain() == {"done": 2, "failed": 0, "dead": 0}
        [(headers, body, raw)] = hooks.wait_for(1, timeout=5)
    rec = redis_db.hgetall(names.job_key("job_hook")) | {"text": "Paris."}
    assert body == json.loads(Job.from_record(rec).model_dump_json())
    assert body["status"] == "succeeded" and body["text"] == "Paris." and body["usage"]["completion_tokens"] == 3
    assert headers["x-conveyor-job"] == "job_hook"
    assert headers["x-conveyor-signature"] == sign(raw, "s3cret", headers["x-conveyor-timestamp"])
    assert abs(int(headers["x-conveyor-timestamp"]) - time.time()) < 60


def test_a_webhook_carries_the_logprobs_a_poll_shows(redis_db: redis.Redis) -> None:
    entries = [[1, "Paris", -0.1, [[1, "Paris", -0.1]]], [2, ".", -0.5, [[2, ".", -0.5]]]]
    redis_db.set(names.logprobs_key("job_lp"), "\n".join(json.dumps(e) for e in entries))
    with webhook_server() as hooks:
        end_job(redis_db, "job_lp", hooks.url)
        assert after(redis_db).drain()["done"] == 1
        [(_, body, _)] = hooks.wait_for(1, timeout=5)
    assert [lp["token"] for lp in body["logprobs"]] == ["Paris", "."] and body["logprobs"][1]["logprob"] == -0.5


def test_a_tenants_job_is_signed_with_the_tenants_secret(redis_db: redis.Redis) -> None:
    redis_db.hset(names.tenant_key("acme"), mapping={"key_sha256": "ab" * 32, "webhook_secret": "s1"})
    redis_db.hset(names.tenant_key("plain"), mapping={"key_sha256": "cd" * 32})  # no secret of its own
    worker = after(redis_db, webhook_secret="global")
    with webhook_server() as hooks:
        end_job(redis_db, "job_acme", hooks.url, owner="acme")
        end_job(redis_db, "job_plain", hooks.url, owner="plain")
        end_job(redis_db, "job_nobody", hooks.url, owner="")  # auth off
        assert worker.drain() == {"done": 3, "failed": 0, "dead": 0}
        received = {h["x-conveyor-job"]: (h, raw) for h, _, raw in hooks.wait_for(3, timeout=5)}
    secrets = {"job_acme": "s1", "job_plain": "global", "job_nobody": "global"}
    for job_id, secret in secrets.items():
        headers, raw = received[job_id]
        assert headers["x-conveyor-signature"] == sign(raw, secret, headers["x-conveyor-timestamp"]), job_id

    unsigned = after(redis_db)  # no WEBHOOK_SECRET: only a tenant with its own secret signs
    with webhook_server() as hooks:
        end_job(redis_db, "job_acme_2", hooks.url, owner="acme")
        end_job(redis_db, "job_nobody_2", hooks.url)
        assert unsigned.drain()["done"] == 2
        received = {h["x-conveyor-job"]: (h, raw) for h, _, raw in hooks.wait_for(2, timeout=5)}
    headers, raw = received["job_acme_2"]
    assert headers["x-conveyor-signature"] == sign(raw, "s1", headers["x-conveyor-timestamp"])
    assert "x-conveyor-signature" not in received["job_nobody_2"][0]


def test_failing_webhook_retried_then_dead_lettered(redis_db: redis.Redis) -> None:
    worker = after(redis_db)
    with webhook_server() as hooks:
        hooks.fail_first = 1
        end_job(redis_db, "job_flaky", hooks.url)
        assert worker.drain() == {"done": 0, "failed": 1, "dead": 0}
        assert redis_db.hget(names.job_key("job_flaky"), "webhook_error") == "answered 500"
        assert worker.drain() == {"done": 1, "failed": 0, "dead": 0}  # the retry goes through
        assert len(hooks.received) == 2
        assert redis_db.hget(names.job_key("job_flaky"), "webhook_error") is None  # over: not left on the record

        hooks.fail_first = 100
        end_job(redis_db, "job_down", hooks.url)
        results = [worker.drain() for _ in range(4)]
        assert [c["failed"] for c in results] == [1, 1, 1, 0] and results[3]["dead"] == 1
        assert len(hooks.received) == 2 + 3  # three tries, then the dead-letter stream
    [(_, dead)] = redis_db.xrange(names.stream(names.DEAD, 0))
    assert dead["job_id"] == "job_down" and dead["source_stream"] == names.stream(names.ENDED, 0)
    assert dead["reason"].endswith("last webhook failure: answered 500")
    assert redis_db.hget(names.job_key("job_down"), "webhook_error") == "answered 500"
    assert redis_db.hget(names.usage_key(), "m:jobs") == "2"  # retries never count a job twice
    assert worker.drain() == {"done": 0, "failed": 0, "dead": 0}


def test_bad_webhooks_fail_alone(redis_db: redis.Redis) -> None:
    """Nothing listening, a server that does not speak HTTP, a redirect: each is a failed try of
    its own job; the other jobs of the batch are accounted and done."""
    garbage = socket.create_server(("127.0.0.1", 0))

    def answer_garbage() -> None:
        while True:
            try:
                conn, _ = garbage.accept()
            except OSError:
                return
            conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")
            conn.close()

    threading.Thread(target=answer_garbage, daemon=True).start()
    worker = after(redis_db, webhook_timeout_s=1)
    with webhook_server() as hooks:
        hooks.status = 302
        end_job(redis_db, "job_nowhere", "http://127.0.0.1:9/hook")  # discard port: nothing listens
        end_job(redis_db, "job_garbage", f"http://127.0.0.1:{garbage.getsockname()[1]}/hook")
        end_job(redis_db, "job_redirected", hooks.url)
        for n in range(5):
            end_job(redis_db, f"job_fine_{n}")
        assert worker.drain() == {"done": 5, "failed": 3, "dead": 0}
        assert len(hooks.received) == 1  # the redirect was not followed
    garbage.close()
    why = {job_id: redis_db.hget(names.job_key(job_id), "webhook_error")
           for job_id in ("job_nowhere", "job_garbage", "job_redirected")}
    assert why["job_redirected"] == "answered 302 (a redirect; not followed)"
    assert why["job_nowhere"].startswith("ConnectionRefusedError")  # type: ignore[union-attr]
    assert why["job_garbage"].split(":")[0] in (  # type: ignore[union-attr]
        "BadStatusLine", "BrokenPipeError", "ConnectionResetError", "RemoteDisconnected")  # as the race goes
    assert redis_db.hget(names.usage_key(), "m:jobs") == "8"


def test_one_drain_takes_a_backlog(redis_db: redis.Redis) -> None:
    worker = after(redis_db)
    for n in range(450):
        end_job(redis_db, f"job_many_{n}")
    assert worker.drain(batch=200) == {"done": 450, "failed": 0, "dead": 0}
    assert redis_db.hget(names.usage_key(), "m:jobs") == "450"


@contextlib.contextmanager
def waiting_drain(worker: AfterJob, budget_s: float) -> Iterator[tuple[threading.Thread, dict[str, int]]]:
    """A drain waiting for ends (500 ms at a time) in a thread: the thread and, once it returns, its counts. On exit,
    stopped as at a worker's warm shutdown (it returns after its current wait), and joined."""
    result: dict[str, int] = {}
    t = threading.Thread(target=lambda: result.update(worker.drain(budget_s=budget_s, wait_ms=500)))
    t.start()
    try:
        yield t, result
    finally:
        worker.stopping.set()
        t.join(timeout=10)
    assert not t.is_alive()


def test_a_waiting_drain_sends_webhooks_as_jobs_end(redis_db: redis.Redis) -> None:
    worker = after(redis_db)
    t0 = time.monotonic()
    assert worker.drain(budget_s=0.5, wait_ms=200) == {"done": 0, "failed": 0, "dead": 0}
    assert 0.45 < time.monotonic() - t0 < 2  # nothing ended: it waited out its budget, no longer
    with webhook_server() as hooks, waiting_drain(worker, 30) as (t, result):
        until("the drain to wait on Redis", lambda: blocked_on(redis_db, "xreadgroup"))
        end_job(redis_db, "job_live", hooks.url)
        assert hooks.wait_for(1, timeout=5), "no webhook while the drain was waiting"
        assert t.is_alive()  # sent as the job ended, not when the drain returned
    assert result == {"done": 1, "failed": 0, "dead": 0}


def test_a_waiting_drain_outlives_a_redis_outage(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Redis gone in the middle of a run (restarted, a master failed over): the drain waits it out, backing off,
    and goes on with its run; it used to raise, which ended the run and left ends without their webhooks (and
    batches without their driver) until beat's next run, up to 30 s later."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        client = sync_client(server.url)
        worker = after(client)
        with webhook_server() as hooks, waiting_drain(worker, 60) as (t, result):
            until("the drain to wait on Redis", lambda: blocked_on(client, "xreadgroup"))
            server.stop()
            until("the drain to see the outage (or die of it)",
                  lambda: "redis unavailable" in caplog.text or not t.is_alive(), timeout=60)
            server.start()  # same port, same data
            end_job(client, "job_after_restart", hooks.url)
            assert hooks.wait_for(1, timeout=15), "no webhook after the restart"
            assert t.is_alive()  # the same run
        assert result["done"] == 1
        client.close()
    finally:
        server.stop()


def test_an_entry_retried_while_its_delivery_waits_is_not_sent_twice(redis_db: redis.Redis) -> None:
    """A slow endpoint's backlog outlasts a round's wait: its deliveries still queued or running when their entries
    come back (a retry) are the ones waited for, not queued again ahead of every other delivery."""
    worker = AfterJob(redis_db, Settings(webhook_allow_private=True), consumer="after-slow", parallel=1)
    release, calls = threading.Event(), []

    def slow(job_id: str) -> str | None:
        calls.append(job_id)
        release.wait(10)
        return None

    first = [worker._deliver(("s", f"{i}-0"), slow, f"job_{i}") for i in range(3)]
    again = [worker._deliver(("s", f"{i}-0"), slow, f"job_{i}") for i in range(3)]
    assert again == first  # the same deliveries, none queued twice
    release.set()
    assert [f.result(timeout=10) for f in first] == [None] * 3 and calls == ["job_0", "job_1", "job_2"]
    worker.close()



def _hanging_endpoint(held: list[socket.socket] | None = None) -> socket.socket:
    """A listening socket whose connections are accepted (into `held`) and never answered (close it when done)."""
    hanging = socket.create_server(("127.0.0.1", 0), backlog=200)
    held = [] if held is None else held

    def hold() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(hanging.accept()[0])

    threading.Thread(target=hold, daemon=True).start()
    return hanging


def _read(r: redis.Redis, stream: str, entry_id: str) -> bool:
    """Whether the drain's group has read the entry (its last delivered id is at or past it)."""
    group = next(g for g in r.xinfo_groups(stream) if text(g["name"]) == names.AFTER_JOB_GROUP)
    last = text(group["last-delivered-id"])
    return tuple(map(int, last.split("-"))) >= tuple(map(int, entry_id.split("-")))


def test_a_webhook_waiting_behind_a_hanging_endpoint_is_sent_once_not_dead_lettered(redis_db: redis.Redis) -> None:
    """One tenant's endpoint hangs and its deliveries fill the pool: another tenant's delivery waits for a thread,
    and that wait is no failed try (it was dead-lettered unsent); sent once, it is acknowledged, never sent again."""
    hanging = _hanging_endpoint()
    worker = AfterJob(redis_db, Settings(webhook_timeout_s=0.5, webhook_retry_s=0.5, webhook_attempts=2,
                                         webhook_allow_private=True), consumer="after-hol", parallel=2)
    stream = names.stream(names.ENDED, 0)

    def settled() -> bool:  # the other tenant's entry read and acknowledged, or dead-lettered
        worker.drain(budget_s=1, wait_ms=200)
        pending = {text(p["message_id"]) for p in redis_db.xpending_range(stream, names.AFTER_JOB_GROUP, "-", "+", 100)}
        other = next(eid for eid, m in redis_db.xrange(stream) if m["job_id"] == "job_other")
        return other not in pending and _read(redis_db, stream, other)

    with webhook_server() as hooks:
        for i in range(24):  # 6 s of the two threads' time, past several retries of the waiting delivery
            end_job(redis_db, f"job_hang_{i}", f"http://127.0.0.1:{hanging.getsockname()[1]}/hook", owner="a")
        end_job(redis_db, "job_other", hooks.url, owner="b")
        until("the other tenant's entry settled", settled, timeout=60, every=0)
        assert "job_other" not in [m["job_id"] for _, m in redis_db.xrange(names.stream(names.DEAD, 0))]
        assert [body["id"] for _, body, _ in hooks.received] == ["job_other"]
    worker.close()
    hanging.close()


def test_a_failed_webhook_is_tried_again_later_and_later(redis_db: redis.Redis) -> None:
    """A receiver down for a while gets its webhook when it is back: tries WEBHOOK_RETRY_S apart at first, then twice
    as far each time (up to WEBHOOK_RETRY_MAX_S), WEBHOOK_ATTEMPTS in all; a try not yet due is not made."""
    worker = AfterJob(redis_db, Settings(webhook_retry_s=0.2, webhook_retry_max_s=0.8, webhook_attempts=6,
                                         webhook_allow_private=True), consumer="after-backoff")
    assert [worker._backoff_ms(n) for n in range(1, 6)] == [200, 400, 800, 800, 800]
    with webhook_server() as hooks:
        hooks.fail_first = 4
        end_job(redis_db, "job_later", hooks.url)
        start = time.monotonic()
        while len(hooks.received) < 5 and time.monotonic() - start < 20:
            worker.drain(budget_s=0.05)
        tries = hooks.arrived_at  # as the receiver saw them (the loop's own view lags by a drain, more under load)
        assert len(hooks.received) == 5, tries  # four failures, then it went through
        gaps = [b - a for a, b in zip(tries, tries[1:])]
        assert all(gap >= want - 0.05 for gap, want in zip(gaps, (0.2, 0.4, 0.8, 0.8))), gaps
    assert not redis_db.xrange(names.stream(names.DEAD, 0))
    assert worker.drain() == {"done": 0, "failed": 0, "dead": 0}
    worker.close()


@pytest.mark.slow
def test_deliveries_hanging_endpoints_hold_wait_in_redis_not_in_memory(redis_db: redis.Redis) -> None:
    """A tenant whose endpoints hang (one job each: an endpoint that let a delivery time out is tried by one at a
    time, below) ends jobs faster than the pool gives up on them: the drain reads new ends only while its deliveries
    in hand are few (OUTSTANDING_PER_THREAD a thread); the rest wait on the stream."""
    endpoints = [_hanging_endpoint() for _ in range(60)]
    worker = AfterJob(redis_db, Settings(webhook_timeout_s=0.5, webhook_retry_s=30, webhook_allow_private=True),
                      consumer="after-backlog", parallel=2)
    for i in range(60):
        port = endpoints[i % len(endpoints)].getsockname()[1]
        end_job(redis_db, f"job_backlog_{i}", f"http://127.0.0.1:{port}/hook", owner="a")
    most = 0
    for _ in range(6):
        worker.drain(budget_s=0.5, wait_ms=100)
        most = max(most, len(worker._inflight))
    assert 0 < most <= worker.outstanding_max == OUTSTANDING_PER_THREAD * 2
    stream = names.stream(names.ENDED, 0)
    last = next(eid for eid, m in redis_db.xrange(stream) if m["job_id"] == "job_backlog_59")
    assert not _read(redis_db, stream, last)  # the rest wait on the stream, unread
    worker.close()
    for hanging in endpoints:
        hanging.close()


def test_an_endpoint_that_hangs_holds_one_delivery_thread_not_all(redis_db: redis.Redis) -> None:
    """Once a host has let a delivery time out, one delivery at a time tries it, PROBE_EVERY_S apart (for SILENT_S);
    the others fail at once and are retried after their backoff, as any failure: another tenant's webhook goes out
    beside them, and the hanging host is not sent a connection per delivery (it held both threads WEBHOOK_TIMEOUT_S
    each, every other tenant's webhooks behind them)."""
    held: list[socket.socket] = []
    hanging = _hanging_endpoint(held)
    worker = AfterJob(redis_db, Settings(webhook_timeout_s=0.5, webhook_retry_s=30, webhook_allow_private=True),
                      consumer="after-silent", parallel=2)
    with webhook_server() as hooks:
        end_job(redis_db, "job_hang_first", f"http://127.0.0.1:{hanging.getsockname()[1]}/hook", owner="a")
        assert worker.drain() == {"done": 0, "failed": 1, "dead": 0}  # it timed out
        for i in range(24):
            end_job(redis_db, f"job_hang_{i}", f"http://127.0.0.1:{hanging.getsockname()[1]}/hook", owner="a")
        end_job(redis_db, "job_other", hooks.url, owner="b")
        counts = worker.drain()
        assert counts["done"] == 1 and counts["failed"] == 24, counts
        assert [body["id"] for _, body, _ in hooks.received] == ["job_other"]
        assert len(held) <= 2  # the first delivery's connection, and one probe's
        reasons = {redis_db.hget(names.job_key(f"job_hang_{i}"), "webhook_error") for i in range(24)}
        assert any(r and "let a delivery time out" in r and "not tried" in r for r in reasons), reasons
    worker.close()
    hanging.close()


def test_an_end_handled_after_its_record_expired_is_dead_lettered(redis_db: redis.Redis) -> None:
    """A webhook still being retried when its job's record expires cannot be sent: its end is dead-lettered, saying
    so, not acknowledged as if delivered (it was, silently: never sent, no trace)."""
    worker = after(redis_db)
    with webhook_server() as hooks:
        hooks.fail_first = 100
        end_job(redis_db, "job_gone", hooks.url)
        assert worker.drain() == {"done": 0, "failed": 1, "dead": 0}
        redis_db.delete(names.job_key("job_gone"))  # its record expires (JOB_TTL_S) while the webhook waits
        assert worker.drain() == {"done": 0, "failed": 0, "dead": 1}
        assert len(hooks.received) == 1
    [(_, dead)] = redis_db.xrange(names.stream(names.DEAD, 0))
    assert dead["job_id"] == "job_gone" and "record expired" in dead["reason"], dead
    assert not redis_db.xpending(names.stream(names.ENDED, 0), names.AFTER_JOB_GROUP)["pending"]
    worker.close()


def test_a_drain_kept_busy_by_ends_keeps_its_heartbeat(redis_db: redis.Redis) -> None:
    """Ends arriving all through a drain's run: it beats as it goes, not once a run (its heartbeat, 10 s at least,
    ran out during a run kept busy past it, and another worker took its entries for a dead one's)."""
    worker = after(redis_db, claim_idle_ms=2000)
    stop = threading.Event()

    def feed() -> None:
        i = 0
        while not stop.wait(0.1):
            end_job(redis_db, f"job_steady_{i}", None)
            i += 1

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    started = time.time()
    try:
        worker.drain(budget_s=4, wait_ms=500)
    finally:
        stop.set()
        feeder.join()
    expiry = redis_db.zscore(names.workers_key(names.CELERY_POOL), worker.consumer.consumer)
    assert expiry is not None and expiry >= started + 10 + 2.5, expiry - started  # beaten again 2.5 s on or later
    worker.close()
