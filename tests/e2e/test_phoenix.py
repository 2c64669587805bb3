"""`conveyor up --traces` end to end: a stack with its own Phoenix (infra/phoenix.py) gets a job submitted with a
client's `traceparent`; Phoenix's GraphQL API then holds that trace, in the project `conveyor`, with the submit's
span and every stage's span under it, and its page in headless Chromium (bench/phoenix_shot.py) shows every span's
name. Once the stack is stopped no Phoenix is left running."""

from __future__ import annotations

import secrets
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import redis

from bench import phoenix_shot
from harness.stack import start_stack, stop_stack
from infra import phoenix
from infra.redis_server import free_port
from tests.e2e.test_traces import STAGES

ROOT_SPAN = "POST /v1/jobs"
NAMES = (ROOT_SPAN, *STAGES)
TRACE_WAIT_S = 60.0  # each process exports its batch every 5 s (the SDK's default), the last as the job ends
PAGE_WAIT_S = 60.0
# the supervisor waits for Phoenix before the pools, then starts them anyway; Phoenix's first start (its imports,
# its database's migrations) has taken over 90 s on a fresh, loaded machine, so the test waits on it longer
PHOENIX_WAIT_S = 240.0


def _port_pair() -> int:
    """A free port whose next is free too: Phoenix's own and its OTLP/gRPC's (`phoenix.grpc_port`)."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind((phoenix.HOST, phoenix.grpc_port(port)))
            except OSError:
                continue
        return port
    raise RuntimeError("no two free ports in a row")


def _stream_to_done(url: str) -> None:
    with httpx.stream("GET", url, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line == "event: done":
                return
    raise AssertionError("the stream ended without its done event")


def _wait_for_spans(base: str, trace_id: str) -> dict[str, Any]:
    """Phoenix's trace once it holds a span of every name in NAMES (they arrive in each process's batches)."""
    deadline = time.monotonic() + TRACE_WAIT_S
    trace = None
    while time.monotonic() < deadline:
        trace = phoenix_shot.trace_spans(base, trace_id)
        if trace is not None and {s["name"] for s in trace["spans"]} >= set(NAMES):
            return trace
        time.sleep(0.5)
    got = sorted(s["name"] for s in trace["spans"]) if trace else None
    raise AssertionError(f"after {TRACE_WAIT_S:g} s Phoenix's trace {trace_id} has the spans {got}")


def _phoenix_processes(port: int) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        line = " ".join(p.info["cmdline"] or ())
        if "phoenix serve" in line and str(port) in line.split():
            found.append(p)
    return found


@pytest.mark.slow
def test_a_job_submitted_to_a_traced_stack_is_one_trace_in_phoenix_and_on_its_page(  # type: ignore[no-untyped-def]
        tmp_path: Path, redis_server, tiny_model_dir: str) -> None:
    if phoenix.find_phoenix() is None:
        pytest.fail(phoenix.MISSING)
    url = redis_server.url.rsplit("/", 1)[0] + "/6"
    redis.Redis.from_url(url).flushdb()
    port = _port_pair()
    base = phoenix.ui_url(port)
    stack = start_stack(tmp_path / "stack", url, tiny_model_dir, args=["--traces", "--traces-port", str(port)])
    try:
        assert phoenix.wait_ready(port, PHOENIX_WAIT_S), f"Phoenix not answering after {PHOENIX_WAIT_S:g} s"
        trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
        sub = httpx.post(f"{stack.url}/v1/jobs", json={"prompt": "Once upon a time", "max_tokens": 8},
                         headers={"traceparent": f"00-{trace_id}-{client_span}-01"})
        assert sub.status_code == 202, sub.text
        _stream_to_done(f"{stack.url}/v1/jobs/{sub.json()['id']}/events")

        trace = _wait_for_spans(base, trace_id)
        assert trace["traceId"] == trace_id and trace["project"]["name"] == phoenix.PROJECT
        [root] = [s for s in trace["spans"] if s["name"] == ROOT_SPAN]
        assert root["parentId"] == client_span  # the client's span, which Phoenix never got
        parents = {s["name"]: s["parentId"] for s in trace["spans"] if s["name"] in STAGES}
        assert parents == dict.fromkeys(STAGES, root["spanId"])  # each stage a child of the submit

        shot = tmp_path / "trace.png"
        missing = phoenix_shot.shoot(phoenix_shot.trace_page(base, trace), list(NAMES), shot, PAGE_WAIT_S,
                                     1600, 1000)
        print(f"screenshot of trace {trace_id}: {shot}")
        assert missing == [], (f"not on the trace's page after {PAGE_WAIT_S:g} s: {missing} (see {shot} and "
                              f"{shot.with_suffix('.console.txt')})")
        assert shot.stat().st_size > 0
    finally:
        stop_stack(stack)
    assert _phoenix_processes(port) == []
