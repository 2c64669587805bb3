"""The command line: a worker started without its model says what to do instead of a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


@pytest.mark.parametrize("pool", ["tokenizer", "inference"])
def test_worker_without_a_model_says_how_to_get_one(pool: str, tmp_path: Path) -> None:
    env = {**os.environ, "MODEL": str(tmp_path), "REDIS_URL": "redis://127.0.0.1:1/0"}
    out = subprocess.run([sys.executable, "-m", "infra.cli", pool], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1
    assert f"no model at {tmp_path}" in out.stderr and "conveyor model pull" in out.stderr
    assert "Traceback" not in out.stderr


def test_commands_beside_a_stack_take_its_partitions_and_models(redis_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`conveyor up --redis-cluster 3` gives its stack 12 partitions and `--model` its models, in its own
    environment: `conveyor keys` and `conveyor status` run from another shell read them from the stack's connection
    file, so a key lands in the partition where the stack's API looks for it and status shows every model's pool."""
    import json

    import redis

    from shared import names

    url = redis_server.url.rsplit("/", 1)[0] + "/4"
    r = redis.Redis.from_url(url)
    r.flushdb()
    (tmp_path / "redis").mkdir()
    (tmp_path / "redis" / "connection.json").write_text(json.dumps(
        {"url": url, "env": {"REDIS_PARTITIONS": "12", "MODELS": f"a={tmp_path},b={tmp_path}"}}))
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "REDIS_PARTITIONS", "MODELS")}
    env["CONVEYOR_CACHE"] = str(tmp_path)
    try:
        for argv in (["keys", "create", "team-x"], ["status"]):
            out = subprocess.run([sys.executable, "-m", "infra.cli", *argv], cwd=ROOT, env=env, capture_output=True,
                                 text=True, timeout=120)
            assert out.returncode == 0, out.stderr
        assert "inference:b" in out.stdout
        with names.partitions_as(12):
            assert r.exists(names.tenant_key("team-x"))
    finally:
        r.flushdb()
