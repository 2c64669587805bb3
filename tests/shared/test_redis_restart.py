"""The API's Redis client after a Redis restart: every pooled connection the restart left stale is reconnected by
the client's retry, so no request fails once Redis is back (before, each stale connection failed its next
request, and a poll answered 503 long after the restart)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from shared.redis_client import async_client, sync_client


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, tmp: Path) -> None:
        self.port, self.tmp = _free_port(), tmp
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.tmp)], stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                if redis.Redis(port=self.port, socket_connect_timeout=0.2).ping():
                    return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    s = Server(tmp_path)
    s.start()
    yield s
    s.stop()


async def test_no_request_fails_once_redis_is_back(server: Server) -> None:
    r = async_client(f"redis://127.0.0.1:{server.port}/0")
    try:
        await r.set("k", "v")

        async def poll() -> object:
            pipe = r.pipeline(transaction=False)
            pipe.get("k")
            pipe.hgetall("h")
            return await pipe.execute()

        await asyncio.gather(*[poll() for _ in range(24)])  # a pool of many connections
        server.stop()
        server.start()  # the same port, an empty dataset: every pooled connection is now stale
        got = await asyncio.gather(*[r.get("k") for _ in range(8)], *[poll() for _ in range(8)],
                                   return_exceptions=True)
        assert not [g for g in got if isinstance(g, BaseException)]
    finally:
        await r.aclose()


def test_a_client_made_while_no_node_answers_is_an_error_not_a_guess(server: Server) -> None:
    """A process that starts while its Redis does not answer cannot tell a cluster from a single node: it says so
    (ConnectionError, and it is started again) rather than take it for a single node, whose client would follow no
    MOVED once a cluster's seed came back (every call failed for good). Once a node answers, it is asked again."""
    url = f"redis://127.0.0.1:{server.port}/0"
    server.stop()
    with pytest.raises(redis.ConnectionError, match="cannot tell a cluster from a single node"):
        sync_client(url, wait_s=0.3)
    server.start()
    assert sync_client(url, wait_s=0.3).ping()
