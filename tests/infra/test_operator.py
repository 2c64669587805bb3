"""What operators and their tools read: /health and /version as vLLM serves them, /v1/models with
max_model_len, and `conveyor status` in a terminal. Against the session's stack."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import ROOT


def test_health_version_and_models(stack: Any) -> None:
    assert httpx.get(stack.url + "/health").status_code == 200
    assert httpx.get(stack.url + "/version").json()["version"]
    model = httpx.get(stack.url + "/v1/models").json()["data"][0]
    assert model["max_model_len"] == 1024  # the stack's MAX_MODEL_LEN, below the model's own 8192


def test_conveyor_status_shows_pools_and_pids(stack: Any) -> None:
    out = subprocess.run([sys.executable, "-m", "infra.cli", "status"], cwd=ROOT, env=stack.env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    state = json.loads((Path(stack.env["CONVEYOR_CACHE"]) / "supervisor.json").read_text())
    for pool in ("tokenizer", "inference", "api"):
        assert pool in out.stdout
        for pid in state["pools"][pool]["pids"]:
            assert str(pid) in out.stdout
