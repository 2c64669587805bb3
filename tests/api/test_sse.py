"""The event-stream response under a real uvicorn: headers proxies need, pings on a quiet stream,
the generator closed when the client leaves, and streams ended cleanly at server shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import redis
import uvicorn
from fastapi import FastAPI

from api import sse
from api.sse import EventStream
from infra.redis_server import free_port
from tests.conftest import ROOT

closed: dict[str, float] = {}


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/count/{n}")
    async def count(n: int) -> EventStream:
        async def events() -> AsyncIterator[bytes]:
            for i in range(1, n + 1):
                yield sse.encode(f'{{"i": {i}}}', "token", i)

        return EventStream(events(), ping_s=30)

    @app.get("/quiet/{name}")
    async def quiet(name: str) -> EventStream:
        async def events() -> AsyncIterator[bytes]:
            try:
                yield sse.encode("line one\nline two", "hello")
                await asyncio.sleep(3600)
                yield sse.encode("never")
            finally:
                closed[name] = time.monotonic()

        return EventStream(events(), ping_s=0.2)

    return app


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(_app(), host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(10)


def _wait_closed(name: str, timeout: float = 3.0) -> float:
    deadline = time.monotonic() + timeout
    while name not in closed:
        assert time.monotonic() < deadline, f"the generator of {name} was not closed"
        time.sleep(0.01)
    return closed[name]


def test_events_then_a_clean_end(server: str) -> None:
    with httpx.stream("GET", f"{server}/count/3", timeout=10) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache" and r.headers["x-accel-buffering"] == "no"
        assert "content-length" not in r.headers
        body = r.read().decode()
    assert body == "".join(f'event: token\r\nid: {i}\r\ndata: {{"i": {i}}}\r\n\r\n' for i in (1, 2, 3))


def test_quiet_stream_is_pinged_and_multiline_data_split(server: str) -> None:
    with httpx.stream("GET", f"{server}/quiet/ping", timeout=10) as r:
        lines = r.iter_lines()
        assert [next(lines) for _ in range(4)] == ["event: hello", "data: line one", "data: line two", ""]
        t0 = time.monotonic()
        assert next(lines) == ": ping"
        assert 0.1 < time.monotonic() - t0 < 2.0
        assert [next(lines), next(lines)] == ["", ": ping"]


def test_client_disconnect_closes_the_generator(server: str) -> None:
    with httpx.stream("GET", f"{server}/quiet/leave", timeout=10) as r:
        next(r.iter_lines())
    gone = time.monotonic()
    assert _wait_closed("leave") - gone < 2.0


def test_shutdown_cuts_off_a_stream_that_does_not_end_by_itself(server: str) -> None:
    """A stream whose generator ignores shutdown is cut off after the grace period, its generator
    closed. (The API's own streams end by themselves at once: the SIGTERM test below.)"""
    from sse_starlette.sse import AppStatus

    with httpx.stream("GET", f"{server}/quiet/shutdown", timeout=10) as r:
        lines = r.iter_lines()
        next(lines)
        t0 = time.monotonic()
        AppStatus.should_exit = True  # what uvicorn's exit does to sse-starlette
        try:
            with contextlib.suppress(httpx.RemoteProtocolError):
                list(lines)
        finally:
            AppStatus.should_exit = False
    assert _wait_closed("shutdown", timeout=sse.SHUTDOWN_GRACE_S + 3) - t0 < sse.SHUTDOWN_GRACE_S + 2


def test_api_sigterm_ends_open_streams_and_exits(redis_server) -> None:  # type: ignore[no-untyped-def]
    """`conveyor api` with a stream open on a job nobody runs (its own Redis db, no workers): SIGTERM
    ends the stream properly and the process exits, instead of waiting for the job forever."""
    port = free_port()
    env = {**os.environ, "REDIS_URL": redis_server.url.rsplit("/", 1)[0] + "/14", "PORT": str(port),
           "HOST": "127.0.0.1"}
    api = subprocess.Popen([sys.executable, "-m", "infra.cli", "api"], cwd=ROOT, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and api.poll() is None, "the API did not start"
            time.sleep(0.1)
        job = httpx.post(f"{url}/v1/jobs", json={"prompt": "never run", "max_tokens": 4}).json()
        with httpx.stream("GET", f"{url}/v1/jobs/{job['id']}/events", timeout=10) as r:
            lines = r.iter_lines()
            assert next(lines) == "event: status"
            api.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            list(lines)  # a proper end of the response, not a reset
            assert time.monotonic() - t0 < 5
        # uvicorn re-raises the signal after its graceful exit, into the handler it found (infra/cli.py: 128 + 15)
        assert api.wait(15) in (0, 128 + signal.SIGTERM)
        assert b"Traceback" not in api.stderr.read()  # type: ignore[union-attr]
    finally:
        if api.poll() is None:
            api.kill()
        api.wait()
        redis.Redis.from_url(redis_server.url.rsplit("/", 1)[0] + "/14").flushdb()


def test_encode() -> None:
    assert sse.encode(b'{"a": 1}') == sse.encode('{"a": 1}') == b'data: {"a": 1}\r\n\r\n'
    assert sse.encode(b"x\ny", "token", 7) == b"event: token\r\nid: 7\r\ndata: x\r\ndata: y\r\n\r\n"
    assert sse.encode("[DONE]") == b"data: [DONE]\r\n\r\n"


async def test_a_client_let_go_for_reading_nothing_is_one_line_not_a_traceback(caplog: pytest.LogCaptureFixture
                                                                               ) -> None:
    """A stream whose client stopped reading ends in sse-starlette's SendTimeoutError once its answer has begun:
    the guard notes it in one line and lets the connection close, instead of raising it to uvicorn (which logged a
    150-line traceback per such client)."""
    from sse_starlette.sse import SendTimeoutError

    from api.guard import RequestGuard

    async def stalled(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise SendTimeoutError()

    sent: list[dict[str, object]] = []

    async def send(message) -> None:  # type: ignore[no-untyped-def]
        sent.append(message)

    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {"type": "http", "method": "GET", "path": "/v1/jobs/job_x/events", "headers": [], "query_string": b""}
    with caplog.at_level(logging.INFO, logger="conveyor.api"):
        await RequestGuard(stalled, 1024)(scope, receive, send)
    assert [m["type"] for m in sent] == ["http.response.start"]
    assert any("read nothing" in r.getMessage() for r in caplog.records)
