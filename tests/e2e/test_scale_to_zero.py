"""Scale to zero (`conveyor up --inference 0`): the stack is ready with no inference worker; jobs that arrive at
the empty pool wait, queued (their streams say so), while the supervisor starts one, and then run as usual; once
idle for SCALE_IN_COOLDOWN_S the pool drains back to zero, and the next job brings it up again. Nothing is lost
across either way. On one Redis node and on the local cluster."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from shared import names
from tests.conftest import Stack, start_stack, stop_stack
from tests.helpers import iter_sse, submit, until, wait


@pytest.fixture(scope="module", params=["single", "cluster"])
def zero_stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
               tiny_model_dir: str) -> Iterator[Stack]:
    # its own redis-server (a shared one's databases are all other tests'), or the local cluster
    args = ["--inference", "0"] + ([] if request.param == "single" else ["--redis-cluster", "3"])
    stack = start_stack(tmp_path_factory.mktemp(f"zero-{request.param}"), "", tiny_model_dir, args=args,
                        extra={"AUTOSCALE_PERIOD_S": "0.5", "SCALE_IN_COOLDOWN_S": "3"}, autoscale=True)
    yield stack
    stop_stack(stack)


def _inference_workers(stack: Stack) -> int:
    return len(stack.worker_pids(names.INFERENCE_POOL))


def _stream(url: str, job_id: str, events: list[dict[str, Any]]) -> None:
    with httpx.Client(base_url=url, timeout=180) as c, c.stream("GET", f"/v1/jobs/{job_id}/events") as resp:
        for ev in iter_sse(resp):
            events.append(ev)
            if ev.get("event") in ("done", "error"):
                return


def test_a_pool_at_zero_takes_jobs_and_goes_back_to_zero(zero_stack: Stack) -> None:
    with httpx.Client(base_url=zero_stack.url, timeout=60) as c:
        ready = c.get("/readyz")
        assert ready.status_code == 200 and ready.json()["workers"][names.INFERENCE_POOL] == 0
        assert _inference_workers(zero_stack) == 0
        for round_ in ("from zero", "from zero again"):
            jobs = [submit(c, prompt=f"Job {i}, {round_}:", max_tokens=8, ignore_eos=True) for i in range(4)]
            assert all(j["status"] == "queued" for j in jobs)
            events: list[dict[str, Any]] = []
            streamer = threading.Thread(target=_stream, args=(zero_stack.url, jobs[0]["id"], events))
            streamer.start()
            ended = [wait(c, j["id"], timeout=180) for j in jobs]
            streamer.join(timeout=60)
            assert [e["status"] for e in ended] == ["succeeded"] * 4, round_
            assert all(e["usage"]["completion_tokens"] == 8 for e in ended)
            kinds = [e.get("event") for e in events]
            assert kinds[0] == "status" and kinds[-1] == "done" and "token" in kinds, kinds
            until("the idle pool to drain back to zero", lambda: _inference_workers(zero_stack) == 0, timeout=90,
                  every=0.25)
        assert c.get("/readyz").status_code == 200
