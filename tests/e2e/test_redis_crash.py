"""kill -9 of Redis while jobs run: of the embedded redis-server (the supervisor starts it again from
its append-only file, fsynced before every reply), or of the master of a local Redis Cluster that
holds the queue (its replica takes over; what was answered 202 had reached it). Every process
reconnects by itself, and every job that was answered 202 ends succeeded with the text of a clean
run and an event stream that joins to it without a gap or a repeat; a client that follows a job's
live stream through the outage, resuming with Last-Event-ID, gets it whole. Each stack is its own."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from shared import names
from tests.conftest import Stack, start_stack, stop_stack
from tests.helpers import read_events, tokens_text, until, wait

pytestmark = pytest.mark.slow
KINDS = ("single", "cluster")

JOBS = 30
BODY = {"temperature": 0, "max_tokens": 200, "ignore_eos": True}


def _queue_server(stack: Stack) -> psutil.Process:
    """The redis-server that holds the queue: the only one, or the cluster's master of its slot (of
    partition 0's, with several partitions: one that holds part of the queue)."""
    r = stack.redis()
    if not hasattr(r, "get_node_from_key"):
        state = json.loads((Path(stack.env["CONVEYOR_CACHE"]) / "supervisor.json").read_text())
        return psutil.Process(state["redis_pids"][0])
    port = r.get_node_from_key(names.stream(names.JOBS, 0)).port
    return next(p for _, p in stack.tree() if f"127.0.0.1:{port}" in " ".join(p.cmdline()))


def _listening(port: int) -> bool:
    return any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in psutil.net_connections("tcp"))


def _submit(client: httpx.Client, i: int) -> str | None:
    """The job's id once answered 202; None when Redis was down (503: nothing was promised)."""
    try:
        r = client.post("/v1/jobs", json={**BODY, "prompt": f"Story number {i % 5}:"})
    except httpx.TransportError:
        return None
    if r.status_code == 503:
        return None
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def _follow(url: str, job_id: str, out: list[dict[str, Any]]) -> None:
    """A client on the job's live stream through the outage: when the stream breaks (or cannot be
    opened), it opens it again after the last event it has (Last-Event-ID), until `done`."""
    deadline = time.monotonic() + 180
    with httpx.Client(base_url=url, timeout=30) as client:
        while time.monotonic() < deadline and not (out and out[-1].get("event") == "done"):
            last = next((e["id"] for e in reversed(out) if "id" in e), None)  # as EventSource keeps lastEventId
            headers = {"Last-Event-ID": last} if last else None
            try:
                out += read_events(client, job_id, headers=headers)
            except (httpx.TransportError, AssertionError):  # Redis down: 503, or the stream cut off
                time.sleep(0.2)


def kill_9_of_redis(tmp: Path, tiny_model_dir: str, kind: str) -> None:
    # "": the supervisor's own redis-server, or its own local cluster
    own_stack = start_stack(tmp, "", tiny_model_dir, args=["--redis-cluster", "3"] if kind == "cluster" else [])
    try:
        kill_9_on(own_stack)
    finally:
        stop_stack(own_stack)


def kill_9_on(own_stack: Stack) -> None:
    with httpx.Client(base_url=own_stack.url, timeout=30) as client:
        clean = {i: wait(client, _submit(client, i) or "", timeout=120)["text"] for i in range(5)}
        accepted: dict[str, int] = {}
        live: list[dict[str, Any]] = []
        followed = _submit(client, 0)
        assert followed
        accepted[followed] = 0
        follower = threading.Thread(target=_follow, args=(own_stack.url, followed, live), daemon=True)
        follower.start()
        victim = _queue_server(own_stack)
        port = next(c.laddr.port for c in victim.net_connections("tcp") if c.status == psutil.CONN_LISTEN)
        for i in range(JOBS):
            if i == JOBS // 2:  # half of them queued or running: the server dies with no warning
                os.kill(victim.pid, signal.SIGKILL)
                victim.wait(10)
            job_id = _submit(client, i)
            if job_id:
                accepted[job_id] = i
        until("the supervisor to start the redis-server again", lambda: _listening(port), timeout=30)
        for i in range(JOBS // 2, JOBS):  # and the stack takes work again
            job_id = until("a submit to be accepted again", lambda i=i: _submit(client, i), timeout=60)
            accepted[job_id] = i
        assert len(accepted) >= JOBS // 2
        follower.join(180)
        assert [int(e["id"]) for e in live] == list(range(1, len(live) + 1))  # read live across the outage
        assert live[-1]["event"] == "done" and tokens_text(live) == clean[0]
        for job_id, i in accepted.items():
            final = wait(client, job_id, timeout=180)
            assert final["status"] == "succeeded" and final["text"] == clean[i % 5], (final, clean[i % 5])
            events = read_events(client, job_id)
            assert [int(e["id"]) for e in events] == list(range(1, len(events) + 1))  # no gap, no repeat
            assert tokens_text(events) == final["text"]


@pytest.mark.parametrize("kind", KINDS)
def test_kill_9_of_redis_loses_no_accepted_job(tmp_path: Path, tiny_model_dir: str, kind: str) -> None:
    kill_9_of_redis(tmp_path, tiny_model_dir, kind)
