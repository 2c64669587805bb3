"""guidellm, the usual load tool for OpenAI-compatible servers, runs against the stack unchanged:
its backend check (GET /health) on, two concurrent streams for a few seconds, no request failed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow


def test_guidellm_drives_the_stack(stack: Any, model_path: str, tmp_path: Path) -> None:
    out = tmp_path / "guidellm.json"
    cmd = [str(Path(sys.executable).parent / "guidellm"), "run",
           "--backend", f"kind=openai_http,target={stack.url}",  # validate_backend defaults to GET /health
           "--profile", "kind=concurrent,streams=2", "--constraint", "kind=max_requests,count=6",
           "--data", "kind=synthetic_text,prompt_tokens=24,output_tokens=8",
           "--tokenizer", f"kind=huggingface_auto,model={model_path}",
           "--output", f"kind=json,path={out}", "--disable-console-interactive"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**stack.env, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    totals = json.loads(out.read_text())["benchmarks"][0]["metrics"]["request_totals"]
    assert totals["successful"] == 6 and totals["errored"] == 0, totals
