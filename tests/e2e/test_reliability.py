"""Nothing lost: a killed worker's job resumes elsewhere, poison entries are dead-lettered,
SIGTERM drains, Redis restarts are survived. Inference workers here are started by the tests
themselves (a tiny model), so they can be killed and their exit codes read. Every stack here is the module's
own; the checks on `rstack` run in turn, in one worker (`ON_RSTACK`)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from infra.redis_server import RedisServer
from shared import names
from shared.schemas import Request, encode_request
from shared.signals import read_snapshot
from tests.conftest import ROOT, Stack, start_stack, stop_stack
from tests.helpers import read_events, submit, tokens_text, until, wait, writes_refused

ON_RSTACK = pytest.mark.xdist_group("rstack")  # its tests share the module's `rstack`


def spawn_inference(stack: Stack, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "infra.cli", "inference"], env=stack.env, cwd=ROOT,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT)


def wait_worker(stack: Stack, pid: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while pid not in stack.worker_pids(names.INFERENCE_POOL):
        assert time.monotonic() < deadline, "inference worker did not start"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def rstack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> Iterator[Stack]:
    """The stack its checks share, in turn: a Redis of its own, the tiny model in the default dtype (a resumed
    job's seeded text equals an uninterrupted run's), no inference worker of the supervisor's: the checks start and kill
    their own."""
    tmp = tmp_path_factory.mktemp("reliability")
    server = RedisServer(tmp / "redis")
    server.start()
    try:
        s = start_stack(tmp / "rstack", server.url, tiny_model_dir,
                        extra={"DELIVERY_LIMIT": "2", "DRAIN_GRACE_S": "1"}, args=["--inference", "0"],
                        ready_path="/healthz")
        try:
            yield s
        finally:
            stop_stack(s)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(rstack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=rstack.url, timeout=60) as c:
        yield c


# sampled with a seed: a job resumed elsewhere, or run beside others, must give the text it gives alone, in the
# default dtype (bfloat16 on a CPU with AVX512-BF16 or AMX) as in float32
BODY = {"prompt": "Once upon a time", "temperature": 1.0, "top_p": 0.9, "seed": 1234, "max_tokens": 300,
        "ignore_eos": True}


def running_on(stack: Stack) -> list[int]:
    """Pids of the inference workers holding an entry of the tokenized streams (one not yet acked: a job
    of it still runs there)."""
    r = stack.redis()
    pids = {w.worker_id: w.pid for w in read_snapshot(r, (names.INFERENCE_POOL,), {}).workers[names.INFERENCE_POOL]}
    held = {e["consumer"] for s in names.streams(names.TOKENIZED)
            for e in r.xpending_range(s, names.INFERENCE_GROUP, "-", "+", 100)}
    return [pids[c] for c in held if pids.get(c)]


@ON_RSTACK
def test_killed_worker_job_resumes_on_another(rstack: Stack, client: httpx.Client, tmp_path: Path) -> None:
    # two workers, started together: the one that runs the job is killed, the other resumes it
    workers = {w.pid: w for w in (spawn_inference(rstack, tmp_path / f"w{i}.log") for i in (1, 2))}
    try:
        for pid in workers:
            wait_worker(rstack, pid)
        beats = read_snapshot(rstack.redis(), (names.INFERENCE_POOL,), {}).workers[names.INFERENCE_POOL]
        assert all(w.batch_invariant for w in beats if w.pid in workers)  # the promise the resume below relies on
        reference = wait(client, submit(client, **BODY)["id"])
        assert reference["status"] == "succeeded"
        job = submit(client, **BODY)
        deadline = time.monotonic() + 60
        while client.get(f"/v1/jobs/{job['id']}").json()["usage"]["completion_tokens"] < 30:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        [victim] = until("the job's worker alone holding an entry",
                         lambda: len(held := running_on(rstack)) == 1 and held)
        os.kill(victim, signal.SIGKILL)
        workers[victim].wait()
        assert client.get(f"/v1/jobs/{job['id']}").json()["status"] == "running"
        final = wait(client, job["id"], timeout=300)
    finally:
        for w in workers.values():
            w.terminate()
        for w in workers.values():
            w.wait(30)
    assert final["status"] == "succeeded", final
    assert final["text"] == reference["text"]
    assert final["usage"]["completion_tokens"] == BODY["max_tokens"]
    events = read_events(client, job["id"])
    seqs = [int(e["id"]) for e in events]
    assert seqs == list(range(1, len(seqs) + 1))  # no duplicate and no missing seq
    assert tokens_text(events) == final["text"]


@ON_RSTACK
def test_a_corrupt_row_fails_its_job_alone_and_the_worker_lives(rstack: Stack, client: httpx.Client,
                                                                tmp_path: Path) -> None:
    """A record no request could make (the door refuses it; a corrupt producer could): NaN temperature.
    Its job fails with the reason, a job beside it succeeds, and the worker is never restarted."""
    r = rstack.redis()
    rows = []
    for job_id, temperature in (("job_poison", float("nan")), ("job_mate", 0.0)):
        r.hset(names.job_key(job_id), mapping={"id": job_id, "status": "queued", "model": "tiny",
                                                "created_at": repr(time.time()), "seq": 0})
        rows.append(Request(job_id, [5, 6, 7], max_tokens=5, temperature=temperature, seed=1, ignore_eos=True))
    w = spawn_inference(rstack, tmp_path / "w.log")
    try:
        # both ids name partition 0 (no hex ending): each record goes to its tokenized stream
        for row in rows:
            r.xadd(names.stream(names.TOKENIZED, 0), {"batch": encode_request(row), "jobs": 1})
        poison, mate = (wait(client, j, timeout=120) for j in ("job_poison", "job_mate"))
        assert poison["status"] == "failed" and "temperature" in poison["error"], poison
        assert mate["status"] == "succeeded" and mate["usage"]["completion_tokens"] == 5, mate
        assert w.poll() is None  # the worker that ran them is alive
        assert sum(r.xlen(s) for s in names.streams(names.DEAD)) == 0
    finally:
        w.terminate()
        w.wait(30)

@ON_RSTACK
def test_sigterm_drains_and_exits_zero(rstack: Stack, client: httpx.Client, tmp_path: Path) -> None:
    w = spawn_inference(rstack, tmp_path / "d.log")
    w2 = None
    try:
        wait_worker(rstack, w.pid)
        short = submit(client, prompt="Hello there", max_tokens=40, temperature=0, ignore_eos=True)
        long = submit(client, **{**BODY, "max_tokens": 500})  # outlasts the grace period
        deadline = time.monotonic() + 60
        while client.get(f"/v1/jobs/{long['id']}").json()["usage"]["completion_tokens"] < 5:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        t0 = time.monotonic()
        w.send_signal(signal.SIGTERM)
        # whatever it could not finish in time is handed back and another worker, starting meanwhile, completes it
        w2 = spawn_inference(rstack, tmp_path / "d2.log")
        assert w.wait(timeout=20) == 0
        assert time.monotonic() - t0 < 1 + 10  # the grace period plus shutdown
        for j in (short, long):
            assert wait(client, j["id"], timeout=120)["status"] == "succeeded"
    finally:  # a worker this test started never outlives it
        for proc in (w, w2):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(30)


@contextlib.contextmanager
def _lone_worker(rstack: Stack, client: httpx.Client, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """An inference worker of the test's own, ready, for the body to run jobs on; yields a clean run's job (BODY's
    reference). On leaving, the worker (and its output lane) must have lived through the body, and no process of the
    stack was restarted; the worker is stopped either way."""
    w = spawn_inference(rstack, tmp_path / "w.log")
    roles = {p.pid for _, p in rstack.tree()}
    try:
        wait_worker(rstack, w.pid)
        yield wait(client, submit(client, **BODY)["id"])
        assert w.poll() is None  # the worker and its output lane lived through it
        assert {p.pid for _, p in rstack.tree()} == roles  # and no process of the stack was restarted
    finally:
        w.terminate()
        w.wait(30)


def _ended_whole(client: httpx.Client, ended: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    """Each job succeeded with the reference's text, and its event stream has seqs 1..n and joins to that text."""
    for job in ended:
        assert job["status"] == "succeeded", job
        assert job["text"] == reference["text"]
        events = read_events(client, job["id"])
        assert [int(e["id"]) for e in events] == list(range(1, len(events) + 1))
        assert tokens_text(events) == job["text"]


def _refusals(r: redis.Redis) -> int:
    """How many write refusals (NOREPLICAS) Redis has answered."""
    return int(r.info("errorstats").get("errorstat_NOREPLICAS", {}).get("count", 0))


@ON_RSTACK
def test_jobs_running_when_redis_refuses_writes_wait_and_end_whole(rstack: Stack, client: httpx.Client,
                                                                  tmp_path: Path) -> None:
    """Redis refusing every write for a while (here too few replicas, `min-replicas-to-write`; a failed save on a
    full disk is `MISCONF`, the same to the workers): the jobs running then wait, each loop backing off as in an
    outage, and end whole once it takes writes again, with the text an uninterrupted run gives; no process of the
    stack exits (the output lane used to die failing a job, taking its worker along)."""
    r = rstack.redis()
    with _lone_worker(rstack, client, tmp_path) as reference:
        jobs = [submit(client, **BODY)["id"] for _ in range(4)]
        until("every job under way",
              lambda: all(client.get(f"/v1/jobs/{j}").json()["usage"]["completion_tokens"] >= 5 for j in jobs),
              timeout=60)
        with writes_refused(r, "no replicas"):
            before = _refusals(r)
            assert any(client.get(f"/v1/jobs/{j}").json()["status"] == "running" for j in jobs)
            refused = client.post("/v1/jobs", json=BODY)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "2", refused.text
            until("the workers refused a while", lambda: _refusals(r) >= before + 20, timeout=60, every=0.1)
        ended = [wait(client, j, timeout=120) for j in jobs]
    _ended_whole(client, ended, reference)


@ON_RSTACK
def test_a_job_whose_keys_were_damaged_fails_alone(rstack: Stack, client: httpx.Client, tmp_path: Path) -> None:
    """A running job's event stream overwritten by hand (a key of the wrong type): that job fails, saying its output
    was not recorded; the jobs beside it, in the same partition and so in the same step calls, end whole, and the
    worker lives (the whole partition's writes failed every step, and the output lane died failing the job)."""
    r = rstack.redis()
    with _lone_worker(rstack, client, tmp_path) as reference:
        victim, *others = [submit(client, **BODY)["id"] for _ in range(4)]
        until("the job under way",
              lambda: client.get(f"/v1/jobs/{victim}").json()["usage"]["completion_tokens"] >= 5, timeout=60)
        r.delete(names.events_key(victim))
        r.set(names.events_key(victim), "damaged")
        failed = wait(client, victim, timeout=120)
        ended = [wait(client, j, timeout=120) for j in others]
    assert failed["status"] == "failed" and "not recorded" in failed["error"], failed
    assert failed["usage"]["completion_tokens"] < BODY["max_tokens"]  # it ended when its write failed
    _ended_whole(client, ended, reference)


@ON_RSTACK
def test_idempotency_key_returns_same_job(rstack: Stack, client: httpx.Client, tmp_path: Path) -> None:
    h = {"Idempotency-Key": "order-42-" + str(time.time())}
    a = client.post("/v1/jobs", json={"prompt": "Hi", "max_tokens": 3}, headers=h)
    b = client.post("/v1/jobs", json={"prompt": "Hi", "max_tokens": 3}, headers=h)
    assert a.status_code == 202 and b.status_code == 202
    assert a.json()["id"] == b.json()["id"]
    assert b.headers.get("idempotent-replayed") == "true"
    c = client.post("/v1/jobs", json={"prompt": "Hi", "max_tokens": 3}, headers={"Idempotency-Key": "other"})
    assert c.json()["id"] != a.json()["id"]
    client.post(f"/v1/jobs/{a.json()['id']}/cancel")
    client.post(f"/v1/jobs/{c.json()['id']}/cancel")


@pytest.mark.slow
def test_redis_outage_503_then_recovery(tmp_path: Path, tiny_model_dir: str) -> None:
    server = RedisServer(tmp_path / "redis-outage")
    server.start()
    stack = start_stack(tmp_path / "ostack", server.url, tiny_model_dir)
    try:
        with httpx.Client(base_url=stack.url, timeout=30) as c:
            accepted = submit(c, prompt="Remember me", max_tokens=5)
            server.stop()
            r = c.post("/v1/jobs", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 503 and r.headers.get("retry-after")
            assert r.json()["error"]["type"] == "service_unavailable"
            assert c.get(f"/v1/jobs/{accepted['id']}").status_code == 503
            server.start()  # same port, same append-only file
            deadline = time.monotonic() + 60
            while True:
                try:
                    r = c.post("/v1/jobs", json={"prompt": "Back again", "max_tokens": 3})
                    if r.status_code == 202:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "the stack did not recover"
                time.sleep(0.5)
            assert wait(c, r.json()["id"], timeout=90)["status"] == "succeeded"
            assert wait(c, accepted["id"], timeout=90)["status"] in ("succeeded",)
    finally:
        stop_stack(stack)
        server.stop()
