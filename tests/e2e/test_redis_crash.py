"""kill -9 of the embedded redis-server while jobs run: the supervisor starts it again from its
append-only file (fsynced before every reply), every process reconnects by itself, and every job
that was answered 202 ends succeeded with the text of a clean run and an event stream that joins
to it without a gap or a repeat."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import Stack, start_stack, stop_stack
from tests.helpers import read_events, tokens_text, until, wait

pytestmark = pytest.mark.slow

JOBS = 30
BODY = {"temperature": 0, "max_tokens": 200, "ignore_eos": True}


@pytest.fixture
def own_stack(tmp_path: Path, tiny_model_dir: str) -> Iterator[Stack]:
    s = start_stack(tmp_path, "", tiny_model_dir)  # "": the supervisor's own redis-server
    yield s
    stop_stack(s)


def _redis_pid(stack: Stack) -> int:
    state = json.loads((Path(stack.env["CONVEYOR_CACHE"]) / "supervisor.json").read_text())
    return int(state["redis_pid"] or 0)


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


def test_kill_9_of_redis_loses_no_accepted_job(own_stack: Stack) -> None:
    with httpx.Client(base_url=own_stack.url, timeout=30) as client:
        clean = {i: wait(client, _submit(client, i) or "", timeout=120)["text"] for i in range(5)}
        accepted: dict[str, int] = {}
        before = _redis_pid(own_stack)
        for i in range(JOBS):
            if i == JOBS // 2:  # half of them queued or running: the server dies with no warning
                os.kill(before, signal.SIGKILL)
                psutil.Process(before).wait(10)
            job_id = _submit(client, i)
            if job_id:
                accepted[job_id] = i
        until("the supervisor to start redis-server again", lambda: _redis_pid(own_stack) not in (0, before),
              timeout=30)
        for i in range(JOBS // 2, JOBS):  # and the stack takes work again
            job_id = until("a submit to be accepted again", lambda i=i: _submit(client, i), timeout=60)
            accepted[job_id] = i
        assert len(accepted) >= JOBS // 2
        for job_id, i in accepted.items():
            final = wait(client, job_id, timeout=180)
            assert final["status"] == "succeeded" and final["text"] == clean[i % 5], (final, clean[i % 5])
            events = read_events(client, job_id)
            assert [int(e["id"]) for e in events] == list(range(1, len(events) + 1))  # no gap, no repeat
            assert tokens_text(events) == final["text"]
