"""A real HTTP server in a thread that records the webhooks it receives."""

from __future__ import annotations

import json
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Hooks:
    def __init__(self) -> None:
        self.received: list[tuple[dict[str, str], dict[str, Any], bytes]] = []
        self.arrived_at: list[float] = []  # time.monotonic() of each request's arrival, beside `received`
        self.fail_first = 0  # answer 500 to this many requests first
        self.status = 204  # then this (a 3xx comes with a Location)
        self.arrived = threading.Condition()
        self.url = ""
        self.port = 0

    def wait_for(self, n: int, timeout: float) -> list[tuple[dict[str, str], dict[str, Any], bytes]]:
        with self.arrived:
            self.arrived.wait_for(lambda: len(self.received) >= n, timeout)
            return list(self.received)


@contextmanager
def webhook_server(tls: ssl.SSLContext | None = None) -> Iterator[Hooks]:
    """On 127.0.0.1; with `tls` (a server context), HTTPS."""
    hooks = Hooks()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            at = time.monotonic()
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            with hooks.arrived:
                hooks.arrived_at.append(at)
                hooks.received.append(({k.lower(): v for k, v in self.headers.items()}, json.loads(body), body))
                fail = len(hooks.received) <= hooks.fail_first
                hooks.arrived.notify_all()
            self.send_response(500 if fail else hooks.status)
            if 300 <= hooks.status < 400:
                self.send_header("Location", hooks.url)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    hooks.port = server.server_address[1]
    hooks.url = f"{'https' if tls else 'http'}://127.0.0.1:{hooks.port}/hook"
    # a short poll interval: shutdown() waits for the serving loop to notice, up to one interval
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield hooks
    finally:
        server.shutdown()
        server.server_close()
