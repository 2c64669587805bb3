"""Small clients for the tests: submit, wait, and read SSE streams."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx


def iter_sse(resp: httpx.Response) -> Iterator[dict[str, Any]]:
    event: dict[str, Any] = {}
    for line in resp.iter_lines():
        if line == "":
            if "event" in event or "data" in event:
                yield event
            event = {}
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            event[name] = event.get(name, "") + ("\n" if name == "data" and name in event else "") + value


def read_events(client: httpx.Client, job_id: str, headers: dict[str, str] | None = None,
                params: dict[str, Any] | None = None, limit: int | None = None) -> list[dict[str, Any]]:
    """Read a job's SSE stream until `done` (or `limit` token events, then drop the connection)."""
    out: list[dict[str, Any]] = []
    with client.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers, params=params, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for ev in iter_sse(resp):
            if ev.get("event") == "status":
                continue
            out.append(ev)
            if ev.get("event") in ("done", "error"):
                break
            if limit is not None and len(out) >= limit:
                break
    return out


def submit(client: httpx.Client, **body: Any) -> dict[str, Any]:
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == 202, r.text
    return r.json()


def wait(client: httpx.Client, job_id: str, timeout: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not end: {job}")


def tokens_text(events: list[dict[str, Any]]) -> str:
    return "".join(json.loads(e["data"])["text"] for e in events if e.get("event") == "token")


def chat(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]
