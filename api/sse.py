"""Server-sent events as a plain ASGI response: one write per event, a `: ping` comment after
`ping_s` without a write, and the stream stopped (its generator closed, so its `finally` runs)
when the client goes away or the server begins to shut down.

Besides the request's own task, a stream has two: one pumps the generator, one waits for the
client's disconnect and sends the pings; nothing runs per event but the generator and the write.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

PING = b": ping\r\n\r\n"
# no caching, and no buffering in nginx-style proxies, or events arrive in lumps
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

_streams: set[asyncio.Task[None]] = set()  # the pump task of every open stream in this process
_loop: asyncio.AbstractEventLoop | None = None


def encode(data: str | bytes, event: str | None = None, id: int | str | None = None) -> bytes:
    """One event. Multi-line data becomes one `data:` line per line, as the format requires."""
    raw = data.encode() if isinstance(data, str) else data
    head = b""
    if event is not None:
        head += b"event: " + event.encode() + b"\r\n"
    if id is not None:
        head += b"id: " + str(id).encode() + b"\r\n"
    if b"\n" in raw or b"\r" in raw:
        return head + b"".join(b"data: " + line + b"\r\n" for line in raw.splitlines()) + b"\r\n"
    return head + b"data: " + raw + b"\r\n\r\n"


def close_all() -> None:
    """End every open stream (server shutdown): their clients reconnect and resume elsewhere.
    Safe to call from a signal handler."""
    loop = _loop
    if loop is not None and not loop.is_closed():
        loop.call_soon_threadsafe(_cancel_all)


def _cancel_all() -> None:
    for task in list(_streams):
        task.cancel()


class EventStream(Response):
    """`EventStream(events, ping_s)`: `events` yields encoded events (see `encode`)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], ping_s: float, headers: dict[str, str] | None = None) -> None:
        # no body, so no content-length: the way starlette's StreamingResponse sets itself up
        self.status_code = 200
        self.background = None
        self.init_headers({**HEADERS, **(headers or {})})
        self.events = events
        self.ping_s = ping_s
        self.last_write = 0.0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        global _loop
        _loop = asyncio.get_running_loop()
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        self.last_write = _loop.time()
        pump = asyncio.create_task(self._pump(send), name="sse-pump")
        watch = asyncio.create_task(self._watch(receive, send), name="sse-watch")
        _streams.add(pump)
        try:
            await asyncio.wait((pump, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            _streams.discard(pump)
            gone = watch.done() and not watch.cancelled()  # the client disconnected
            watch.cancel()
            pump.cancel()  # the client left, or the server stops: close the generator
            await asyncio.gather(pump, watch, return_exceptions=True)
        if not pump.cancelled() and pump.exception() is not None:
            raise pump.exception()  # type: ignore[misc]
        if not gone:  # ended, or cut short by shutdown: end the response properly
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _pump(self, send: Send) -> None:
        loop = asyncio.get_running_loop()
        async with contextlib.aclosing(self.events) as events:  # type: ignore[type-var]
            async for chunk in events:
                self.last_write = loop.time()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def _watch(self, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                async with asyncio.timeout_at(self.last_write + self.ping_s):
                    message = await receive()
            except TimeoutError:
                if loop.time() - self.last_write >= self.ping_s:
                    self.last_write = loop.time()
                    await send({"type": "http.response.body", "body": PING, "more_body": True})
                continue
            if message["type"] == "http.disconnect":
                return
