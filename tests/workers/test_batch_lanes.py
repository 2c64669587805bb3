"""The Celery worker runs the after-job drain and the batch driver side by side (workers/celery_app.py): the
real worker as `conveyor up` starts it (infra/supervisor.py `celery_argv`: `--pool solo`, beat embedded), on a
database of its own; batches are made through the API in process, and the test plays the inference pool. A
batch's lines flow while the drain waits on an idle `ended` stream, and while the drain is stuck on a webhook
that never answers."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import redis

from api.main import create_app
from infra.redis_server import RedisServer
from infra.supervisor import celery_argv
from shared import names
from shared.job_ops import JobOps
from shared.jobs import FinishReason, JobStatus, new_record
from shared.lifecycle import preexec_die_with_parent
from shared.settings import Settings
from tests.conftest import ROOT
from tests.helpers import blocked_on, until
from workers.batch_driver import WINDOW

pytestmark = pytest.mark.xdist_group("batch_lanes")  # the module's worker, started once
DB = 7
WEBHOOK_TIMEOUT_S = 15  # how long the drain stays stuck on the webhook that never answers


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, model_path: str
           ) -> Iterator[Settings]:
    """The Celery worker (and beat) on db DB, its drain waiting on the idle `ended` stream; the settings of the
    API in this process."""
    url = redis_server.url.rsplit("/", 1)[0] + f"/{DB}"
    r = redis.Redis.from_url(url, decode_responses=True)
    r.flushdb()
    home = tmp_path_factory.mktemp("celery-lanes")
    env = {**os.environ, "REDIS_URL": url, "CELERY_BROKER_URL": url, "MODEL": model_path, "CONVEYOR_CACHE": str(home),
           "WEBHOOK_ALLOW_PRIVATE": "1", "WEBHOOK_TIMEOUT_S": str(WEBHOOK_TIMEOUT_S), "WEBHOOK_RETRY_S": "1",
           "LOG_LEVEL": "WARNING"}
    settings = Settings(redis_url=url, model=model_path, CONVEYOR_CACHE=str(home))
    with open(home / "celery.log", "ab") as log:
        proc = subprocess.Popen(celery_argv(settings), env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=preexec_die_with_parent())
    try:
        until(f"the drain to wait on `ended` (log {home / 'celery.log'})", lambda: blocked_on(r, "xreadgroup"),
              timeout=90, every=0.1)
        yield settings
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        r.flushdb()
        r.close()


@pytest.fixture
def r(worker: Settings) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(worker.redis_url, decode_responses=True)
    yield client
    client.close()


@contextlib.asynccontextmanager
async def _api(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    """The API in process; the database stays (the worker's broker is in it)."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
            yield client


async def _batch(api: httpx.AsyncClient, n: int) -> str:
    lines = "".join(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"messages": [{"role": "user", "content": f"Say {i}."}], "max_tokens": 4}})
                    + "\n" for i in range(n))
    up = await api.post("/v1/files", files={"file": ("in.jsonl", lines.encode())}, data={"purpose": "batch"})
    made = await api.post("/v1/batches", json={"input_file_id": up.json()["id"], "endpoint": "/v1/chat/completions",
                                              "completion_window": "24h"})
    assert made.status_code == 200, made.text
    return str(made.json()["id"])


def _ended(r: redis.Redis, settings: Settings, batch_id: str) -> bool:
    """Play the inference pool for a moment: end every job of the batch in flight; whether the batch has ended."""
    ops = JobOps(r, settings.job_ttl_s)
    for job_id in r.hvals(names.batch_key(batch_id, "inflight")):
        ops.finish(job_id, FinishReason.stop, fields={"completion_tokens": 1})
    return r.hget(names.batch_key(batch_id), "status") == "completed"


def _submitted(r: redis.Redis, batch_id: str) -> int:
    return int(r.hget(names.batch_key(batch_id), "next") or 0)


async def test_lines_flow_while_the_drain_waits_on_an_idle_ended_stream(worker: Settings, r: redis.Redis) -> None:
    until("the drain to wait on `ended`", lambda: blocked_on(r, "xreadgroup"), timeout=30, every=0.05)
    async with _api(worker) as api:
        batch_id = await _batch(api, WINDOW + 40)
    # nothing ends meanwhile: the drain stays blocked for its run (28 s); the driver submits within ticks
    until("a window of lines submitted", lambda: _submitted(r, batch_id) == WINDOW, timeout=8, every=0.05)
    assert not any(r.xlen(s) for s in names.streams(names.ENDED))
    until("the batch to complete", lambda: _ended(r, worker, batch_id), timeout=20, every=0.1)
    assert r.hget(names.batch_key(batch_id), "completed") == str(WINDOW + 40)


def _end_with_webhook(r: redis.Redis, settings: Settings, job_id: str, url: str) -> None:
    record = new_record(job_id, "m", "") | {"status": JobStatus.running.value, "webhook_url": url}
    record.pop("request")
    r.hset(names.job_key(job_id), mapping=record)
    JobOps(r, settings.job_ttl_s).finish(job_id, FinishReason.stop, fields={"completion_tokens": 1})


async def test_a_batch_advances_while_the_drain_is_stuck_on_a_webhook(worker: Settings, r: redis.Redis) -> None:
    with socket.create_server(("127.0.0.1", 0)) as hook:  # listens, never accepts: a webhook that never answers
        job_id = names.job_id_in(0, "a" * 32)
        _end_with_webhook(r, worker, job_id, f"http://127.0.0.1:{hook.getsockname()[1]}/hook")
        until("the drain to call the webhook", lambda: select.select([hook], [], [], 0)[0], timeout=30, every=0.05)
        async with _api(worker) as api:
            batch_id = await _batch(api, 3)
        until("the batch to complete", lambda: _ended(r, worker, batch_id), timeout=WEBHOOK_TIMEOUT_S - 5, every=0.1)
        # the webhook's try has not ended yet (its failure is noted when it does): the batch ran beside it
        assert r.hget(names.job_key(job_id), "webhook_error") is None
