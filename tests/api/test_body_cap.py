"""The body cap as a client on a real socket meets it: the API under uvicorn (both of its HTTP parsers, as
`conveyor api` runs it: httptools) answers a body over the cap with the 413 error object, even to a client
that sends its whole body before it reads anything (urllib, http.client: no `Expect: 100-continue`), and a
body far beyond any bound still has its connection closed at once instead of being read to its end. And an error
no route expected reaches the client as the 500 error object, not as a connection reset."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
import uvicorn

from api import guard
from api.main import create_app
from infra.redis_server import RedisServer, free_port
from shared.limits import MAX_BODY_BYTES
from shared.settings import Settings

BIG = 3 * 2**20  # the README's example: over the 2 MiB cap, well within what is read and discarded
# before the fix about half the tries lost the 413 to a reset (it depends on how much of the body the
# loopback buffers held when the server closed): several tries make the check dependable
TRIES = 6


@pytest.fixture(scope="module", params=["httptools", "h11"])
def server(request: pytest.FixtureRequest, redis_server: RedisServer, model_path: str) -> Iterator[tuple[str, int]]:
    settings = Settings(redis_url=redis_server.url.rsplit("/", 1)[0] + "/13", model=model_path)
    port = free_port()
    app = create_app(settings)

    @app.post("/boom")
    async def boom(body: dict[str, int]) -> None:
        raise RuntimeError("secret internals")

    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                        http=request.param, lifespan="on"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    yield "127.0.0.1", port
    srv.should_exit = True
    thread.join(10)


def _json_body(size: int) -> bytes:
    return b'{"prompt": "' + b"a" * (size - 14) + b'"}'


def _is_413(status: int, raw: bytes) -> None:
    assert status == 413, raw[:200]
    body = json.loads(raw)
    assert set(body) == {"error"} and body["error"]["type"] == "request_too_large", body
    assert str(MAX_BODY_BYTES) in body["error"]["message"]


@pytest.mark.parametrize("attempt", range(TRIES))
def test_urllib_reads_the_413(server: tuple[str, int], attempt: int) -> None:
    host, port = server
    req = urllib.request.Request(f"http://{host}:{port}/v1/jobs", data=_json_body(BIG), method="POST",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=30)
    _is_413(refused.value.code, refused.value.read())


@pytest.mark.parametrize("attempt", range(TRIES))
def test_http_client_reads_the_413(server: tuple[str, int], attempt: int) -> None:
    conn = http.client.HTTPConnection(*server, timeout=30)
    try:
        conn.request("POST", "/v1/jobs", body=_json_body(BIG), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        _is_413(r.status, r.read())
    finally:
        conn.close()


@pytest.mark.parametrize("attempt", range(TRIES))
def test_http_client_chunked_reads_the_413(server: tuple[str, int], attempt: int) -> None:
    """No Content-Length (Transfer-Encoding: chunked): the cap is found while reading, and the rest read too."""
    conn = http.client.HTTPConnection(*server, timeout=30)
    try:
        chunks = (b"a" * 65536 for _ in range(BIG // 65536))
        conn.request("POST", "/v1/jobs", body=chunks, encode_chunked=True,
                     headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
        r = conn.getresponse()
        _is_413(r.status, r.read())
    finally:
        conn.close()


def test_a_client_that_waits_for_100_continue_is_answered_before_it_sends(server: tuple[str, int]) -> None:
    with socket.create_connection(server, timeout=10) as s:
        s.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % BIG)
        assert s.recv(100).split(b" ")[1] == b"413"


def test_a_stalled_body_is_answered_after_the_drain_time(server: tuple[str, int],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(guard, "DRAIN_S", 0.5)
    with socket.create_connection(server, timeout=10) as s:
        s.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % BIG + b"a" * 2**20)  # a third of it, then nothing
        t0 = time.monotonic()
        head = s.recv(100)
        assert head.split(b" ")[1] == b"413" and time.monotonic() - t0 < 5


def _flood(server: tuple[str, int], head: bytes, chunk: bytes) -> tuple[int, float]:
    """Send `head`, then `chunk` over and over until the server closes the connection: (bytes sent, seconds)."""
    sent, t0 = 0, time.monotonic()
    with socket.create_connection(server, timeout=10) as s:
        s.sendall(head)
        try:
            while time.monotonic() - t0 < 30:
                s.sendall(chunk)
                sent += len(chunk)
        except OSError:  # reset or broken pipe: the server closed it
            return sent, time.monotonic() - t0
    raise AssertionError(f"the server was still reading after {sent} bytes")


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_body_far_beyond_any_bound_is_cut_off(server: tuple[str, int], declared: bool) -> None:
    """10 GiB announced (or an endless chunked body): the connection closes after a bounded read, not the body."""
    piece = b"a" * 65536
    if declared:
        head = b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (10 * 2**30)
        chunk = piece
    else:
        head = b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        chunk = b"%x\r\n" % len(piece) + piece + b"\r\n"
    sent, took = _flood(server, head, chunk)
    # what the server drains at most, plus what the two sockets' buffers hold on loopback
    assert sent < guard.DRAIN_BYTES + 32 * 2**20, sent
    assert took < 10, took


def test_an_unexpected_error_reaches_the_client_as_the_500(server: tuple[str, int]) -> None:
    """A route's unexpected exception: the 500 error object with the request id, on a connection that stays open
    (Starlette's last handler answers, then raises again, and uvicorn closed the connection under the answer: a
    client that had sent a body read a reset)."""
    conn = http.client.HTTPConnection(*server, timeout=30)
    try:
        for attempt in range(3):  # one connection: kept open after each
            conn.request("POST", "/boom", body=b'{"a": 1}', headers={"Content-Type": "application/json",
                                                                     "X-Request-Id": f"boom-{attempt}"})
            r = conn.getresponse()
            body = json.loads(r.read())
            assert r.status == 500 and body["error"]["type"] == "internal_error", body
            assert f"boom-{attempt}" in body["error"]["message"] and "secret" not in body["error"]["message"]
            assert r.getheader("x-request-id") == f"boom-{attempt}"
    finally:
        conn.close()
