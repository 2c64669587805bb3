"""A model whose workers cannot start: the failure is recorded (shared/pool_fault.py), the API refuses the model's
new jobs 503 while none of its workers runs rather than queue them for a worker that never comes, /readyz says why,
and the first worker that starts clears it.

Real inference workers (`conveyor inference`) on db 9 of the session's Redis; the API in process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from harness.stack import ROOT
from shared import names
from shared.heartbeat import beat, forget
from shared.pool_fault import FROM_ZERO_RETRY_S, Fault
from shared.settings import Settings
from tests.helpers import auntil, in_process_api, until


@pytest.fixture
def db(redis_server) -> str:  # type: ignore[no-untyped-def]
    url = redis_server.url.rsplit("/", 1)[0] + "/9"
    redis.Redis.from_url(url).flushdb()
    return url


def broken_copy(tiny_model_dir: str, tmp_path: Path) -> str:
    """The tiny model with its weights cut short, as a copy interrupted midway leaves them."""
    path = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, path)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])
    return str(path)


def worker(env: dict[str, str], tmp_path: Path) -> subprocess.Popen[bytes]:
    log = open(tmp_path / "worker.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "infra.cli", "inference"], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, env=dict(os.environ) | {"CONVEYOR_CACHE": str(tmp_path)} | env)


async def test_a_model_that_does_not_load_is_refused_until_a_worker_starts(
        db: str, tiny_model_dir: str, tmp_path: Path) -> None:
    r = redis.Redis.from_url(db)
    broken = broken_copy(tiny_model_dir, tmp_path)
    proc = worker({"REDIS_URL": db, "MODEL": broken, "MODEL_NAME": "tiny"}, tmp_path)
    assert proc.wait(timeout=120) != 0
    fault = Fault.parse(r.get(names.fault_key(names.INFERENCE_POOL)))
    assert fault is not None and fault.failures == 1, fault
    assert f"the weights {broken}/model.safetensors are cut short" in fault.reason, fault
    assert r.ttl(names.fault_key(names.INFERENCE_POOL)) > 0  # it does not outlive a pool nobody restarts

    settings = Settings(redis_url=db, model=broken, model_name="tiny")
    async with in_process_api(settings) as api:
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        for path, body in (("/v1/jobs", {"prompt": "hi"}), ("/v1/chat/completions", chat)):
            got = await api.post(path, json=body)
            assert got.status_code == 503, got.text
            error = got.json()["error"]
            assert error["code"] == "model_unavailable" and "tiny" in error["message"], error
            assert got.headers["retry-after"] == "30"
        assert not r.exists(names.job_key("x")) and not r.keys("*:jobs*")  # nothing was queued
        ready = await api.get("/readyz")
        assert ready.status_code == 503 and "cut short" in ready.json()["faults"]["inference"]["reason"]

        # a worker of the pool that runs serves its jobs, whatever another failed on
        beat(r, names.INFERENCE_POOL, "inference-elsewhere", "{}", 60_000)

        async def accepted() -> bool:
            return (await api.post("/v1/jobs", json={"prompt": "hi"})).status_code == 202
        await auntil("a job accepted beside a live worker", accepted)
        forget(r, names.INFERENCE_POOL, "inference-elsewhere")

    # a worker that starts ends the fault (the synthetic engine: its start is the same path, without weights)
    proc = worker({"REDIS_URL": db, "MODEL": tiny_model_dir, "MODEL_NAME": "tiny", "ENGINE": "synthetic",
                   "DRAIN_GRACE_S": "1"}, tmp_path)
    try:
        until("the started worker to clear the fault", lambda: not r.exists(names.fault_key(names.INFERENCE_POOL)), 60)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)



async def test_a_pool_that_scales_to_zero_is_refused_only_just_after_a_failure(db: str, tiny_model_dir: str) -> None:
    """Nothing restarts a pool at zero but a job that waits: its fault refuses jobs for FROM_ZERO_RETRY_S after the
    latest failure, then a job is taken again (and brings a worker up), so a model mended meanwhile serves."""
    r = redis.Redis.from_url(db)
    settings = Settings(redis_url=db, model=tiny_model_dir, model_name="tiny", inference_min=0)
    key = names.fault_key(names.INFERENCE_POOL)
    async with in_process_api(settings) as api:
        r.set(key, json.dumps({"reason": "OSError: gone", "at": time.time(), "failures": 1}), ex=600)
        assert (await api.post("/v1/jobs", json={"prompt": "hi"})).status_code == 503
        r.set(key, json.dumps({"reason": "OSError: gone", "at": time.time() - FROM_ZERO_RETRY_S - 1, "failures": 1}),
              ex=600)

        async def accepted() -> bool:
            return (await api.post("/v1/jobs", json={"prompt": "hi"})).status_code == 202
        await auntil("a job taken once the latest failure is old", accepted)


def test_a_context_past_the_models_own_is_served_at_the_models_and_said(tiny_model_dir: str,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """MAX_MODEL_LEN past the model's own context serves the model's (as the tokenizer and /v1/models say), with a
    warning naming both; the default (a cap) says nothing."""
    from gpu_worker.worker import build_engine
    from shared.model_config import model_context

    own = model_context(tiny_model_dir, 0)
    for asked, said in ((own * 2, True), (None, False)):
        caplog.clear()
        settings = Settings(model=tiny_model_dir, kv_cache_mb=64, **({} if asked is None else {"max_model_len": asked}))
        assert build_engine(settings).max_model_len == min(own, settings.max_model_len)
        warned = [r.getMessage() for r in caplog.records if "MAX_MODEL_LEN" in r.getMessage()]
        assert bool(warned) == said and (not said or f"({own} tokens): serving {own}" in warned[0]), warned
