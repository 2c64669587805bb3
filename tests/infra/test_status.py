"""`conveyor status` renders what the signals and the fair queue hold, on a real Redis (a database of its own)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from rich.console import Console

from infra import status
from shared import names, pool_fault
from shared.heartbeat import beat
from shared.redis_client import sync_client


def test_status_shows_the_pools_and_the_tenants_share(redis_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    url = redis_server.url.rsplit("/", 1)[0] + "/4"
    c, raw = sync_client(url), sync_client(url, decode=False)
    c.flushdb()
    try:
        c.zadd(names.fair_key(0, "served_by"), {"team-a": 1200, names.ANONYMOUS_TENANT: 300, names.SERVED_TOTAL: 1500})
        c.zadd(names.fair_key(0, "tenants"), {"team-a": 10})
        c.zadd(names.fair_key(0, "queue"), {"team-a:03e800000000001:job_1": 0})
        c.zadd(names.fair_key(0, "age"), {f"team-a:{int((time.time() - 3.2) * 1000):013d}:job_1": 0})
        pool_fault.report(c, names.INFERENCE_POOL, OSError("model.safetensors: truncated"), "loading /m: ")
        for i, invariant in enumerate((True, False)):  # one worker on torch's attention paths (no compiler there)
            beat(c, names.INFERENCE_POOL, f"inference-h-{i}-abcdef", json.dumps({"pid": i, "host": "h",
                 "batch_invariant": invariant}), 60_000)
        console = Console(width=120, record=True)
        console.print(status.render(status.snapshot(c, raw, 64, tmp_path)))
        out = console.export_text()
        # a supervisor killed with SIGKILL left its state behind: its pids are not shown as the stack's
        gone = subprocess.Popen(["true"])
        gone.wait()
        (tmp_path / "supervisor.json").write_text(json.dumps(
            {"pid": gone.pid, "pools": {names.INFERENCE_POOL: {"pids": [gone.pid], "restarts": 3}}}))
        assert status.snapshot(c, raw, 64, tmp_path)["supervisor"] is None
        (tmp_path / "supervisor.json").write_text(json.dumps(
            {"pid": os.getpid(), "pools": {names.INFERENCE_POOL: {"pids": [4242], "restarts": 3}}}))
        assert status.snapshot(c, raw, 64, tmp_path)["supervisor"]["pools"][names.INFERENCE_POOL]["pids"] == [4242]
    finally:
        c.flushdb()
    assert "inference" in out and "tokenizer" in out and "dead letters: 0" in out
    assert "inference: 1 of 2 workers not batch-invariant" in out, out
    assert "inference: failing to start (1 failures" in out and "loading /m: OSError: model.safetensors" in out, out
    [row] = [line for line in out.splitlines() if "team-a" in line]
    assert "1200" in row and "80%" in row and " 1 " in row and "3." in row  # waiting 1, oldest ~3.2 s


def test_status_without_redis_says_so_in_a_line(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """No Redis at the URL: one line saying so and exit code 1, not a traceback."""
    assert status.run("redis://127.0.0.1:1/0", 64, tmp_path, watch=False) == 1
    out = capsys.readouterr().out
    assert "Redis does not answer" in out and "Traceback" not in out and len(out.strip().splitlines()) <= 2
