"""Server-sent events through sse-starlette's `EventSourceResponse`: events are encoded once here
(`encode`, bytes that pass through the library untouched), a `: ping` comment goes out after
`ping_s` without one, a client that stops reading is dropped after SEND_TIMEOUT_S, and the stream
ends (its generator closed, so its `finally` runs) when the client goes away or the server begins
to shut down: streams on the relay end by themselves (`begin_shutdown` wakes them), and
sse-starlette, which watches uvicorn's exit flag, cuts off any other after SHUTDOWN_GRACE_S.
Clients resume elsewhere with Last-Event-ID."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import anyio
from sse_starlette import EventSourceResponse, ServerSentEvent

# no caching, and no buffering in nginx-style proxies, or events arrive in lumps
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SEND_TIMEOUT_S = 30.0  # a client that reads nothing for this long is let go
SHUTDOWN_GRACE_S = 3.0  # at shutdown a stream may end by itself this long before it is cut off

_on_shutdown: list[Callable[[], None]] = []
_loop: asyncio.AbstractEventLoop | None = None


def on_shutdown(callback: Callable[[], None]) -> None:
    """Run `callback` on the event loop when the server begins to shut down (the relay wakes its
    streams, which then end by themselves, completing their responses)."""
    global _loop
    _loop = asyncio.get_running_loop()
    _on_shutdown.append(callback)


def forget_shutdown(callback: Callable[[], None]) -> None:
    if callback in _on_shutdown:
        _on_shutdown.remove(callback)


def begin_shutdown() -> None:
    """Called from the server's signal handler; safe from any thread."""
    loop = _loop
    if loop is not None and not loop.is_closed():
        for callback in _on_shutdown:
            loop.call_soon_threadsafe(callback)


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


def _ping() -> ServerSentEvent:
    return ServerSentEvent(comment="ping")


class EventStream(EventSourceResponse):
    """`EventStream(events, ping_s)`: `events` yields encoded events (see `encode`)."""

    def __init__(self, events: AsyncIterator[bytes], ping_s: float, headers: dict[str, str] | None = None) -> None:
        super().__init__(events, headers={**HEADERS, **(headers or {})}, ping=ping_s, ping_message_factory=_ping,
                         send_timeout=SEND_TIMEOUT_S, shutdown_event=anyio.Event(),
                         shutdown_grace_period=SHUTDOWN_GRACE_S)
