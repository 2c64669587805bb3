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
