"""Small clients for the tests: submit, wait, and read SSE streams (bench/sse_client.py's reader)."""

from __future__ import annotations

import time
from typing import Any

import httpx

from bench.sse_client import iter_sse, read_events, tokens_text
from shared.jobs import TERMINAL

__all__ = ["chat", "iter_sse", "read_events", "submit", "tokens_text", "wait"]


def submit(client: httpx.Client, **body: Any) -> dict[str, Any]:
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == 202, r.text
    return r.json()


def wait(client: httpx.Client, job_id: str, timeout: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in TERMINAL:
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not end: {job}")


def chat(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]
