"""One SSE client for the tests and the benchmarks: an event parser over httpx (sync and async) for
correctness checks, and a bare asyncio HTTP/1.1 reader for load generation.

A load generator shares the CPU with the server it measures, so `raw_events` is HTTP/1.1 on a bare
asyncio connection (one per request, chunked transfer decoded, SSE lines split by hand). In a closed
loop at 32 streams it used 3% of one core where httpx's `aiter_lines` used 7%."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Iterator
from contextlib import aclosing
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx

T = TypeVar("T")


class SseParser:
    """Feeds lines, returns each complete event as {"event", "id", "data"} (fields as sent); comments skipped."""

    def __init__(self) -> None:
        self.event: dict[str, Any] = {}

    def feed(self, line: str) -> dict[str, Any] | None:
        if line == "":
            event, self.event = self.event, {}
            return event if "event" in event or "data" in event else None
        if not line.startswith(":"):
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            self.event[name] = self.event[name] + "\n" + value if name == "data" and name in self.event else value
        return None


def iter_sse(resp: httpx.Response) -> Iterator[dict[str, Any]]:
    parser = SseParser()
    for line in resp.iter_lines():
        if (event := parser.feed(line)) is not None:
            yield event


async def aiter_sse(resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    parser = SseParser()
    async for line in resp.aiter_lines():
        if (event := parser.feed(line)) is not None:
            yield event


def read_events(client: httpx.Client, job_id: str, headers: dict[str, str] | None = None,
                params: dict[str, Any] | None = None, limit: int | None = None) -> list[dict[str, Any]]:
    """A job's SSE stream until `done` or `error` (or `limit` token events, then the connection is
    dropped), without `status` events."""
    out: list[dict[str, Any]] = []
    with client.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers, params=params, timeout=120) as resp:
        if resp.status_code != 200:
            raise AssertionError(f"GET events -> {resp.status_code}: {resp.read()!r}")
        for ev in iter_sse(resp):
            if ev.get("event") == "status":
                continue
            out.append(ev)
            if ev.get("event") in ("done", "error") or (limit is not None and len(out) >= limit):
                break
    return out


async def read_sse(client: httpx.AsyncClient, path: str, timeout: float = 120.0) -> list[dict[str, Any]]:
    """Every event of an SSE stream up to and including `done` or `error` (status events too)."""
    out: list[dict[str, Any]] = []
    async with client.stream("GET", path, timeout=timeout) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"GET {path} -> {resp.status_code}: {(await resp.aread())[:200]!r}")
        async for ev in aiter_sse(resp):
            out.append(ev)
            if ev.get("event") in ("done", "error"):
                break
    return out


def tokens_text(events: list[dict[str, Any]]) -> str:
    return "".join(json.loads(e["data"])["text"] for e in events if e.get("event") == "token")


def check_events(events: list[dict[str, Any]], final_text: str) -> str | None:
    """None when the token events have seqs 1..n and concatenate to final_text; else what is wrong."""
    seqs = [int(e.get("id", -1)) for e in events if e.get("event") == "token"]
    if not events or events[-1].get("event") != "done":
        return "no done event"
    if seqs != list(range(1, len(seqs) + 1)):
        return f"seqs not contiguous: {seqs[:10]}..."
    text = tokens_text(events)
    if text != final_text:
        return f"replay text differs from the final text ({len(text)} vs {len(final_text)} chars)"
    return None


class HttpStatusError(Exception):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:200]!r}")
        self.status = status


async def raw_events(url: str, path: str, body: bytes | None = None, headers: str = "",
                     read_timeout: float | None = None) -> AsyncIterator[list[tuple[bytes, bytes]]]:
    """GET (or POST `body` as JSON) and yield, per read, the complete SSE events it held as (event, data).
    `read_timeout` bounds the connect and each read (a slow but live stream is not cut); None leaves the
    deadline to the caller (`asyncio.timeout` around the whole stream: no timer per read). A status other
    than 200 raises HttpStatusError. Use with `contextlib.aclosing` when stopping early."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"an http:// URL is needed, not {url!r}")
    host, port = parts.hostname, parts.port or 80

    def timed(aw: Awaitable[T]) -> Awaitable[T]:
        return asyncio.wait_for(aw, read_timeout) if read_timeout else aw

    reader, writer = await timed(asyncio.open_connection(host, port, limit=2**20))
    try:
        head = (f"{'GET' if body is None else 'POST'} {parts.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {host}\r\n"
                f"Accept: text/event-stream\r\n{headers}")
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        writer.write((head + "Connection: close\r\n\r\n").encode() + (body or b""))
        reply = await timed(reader.readuntil(b"\r\n\r\n"))
        status = int(reply.split(b" ", 2)[1])
        if status != 200:
            raise HttpStatusError(status, await timed(reader.read()))
        chunked = b"transfer-encoding: chunked" in reply.lower()
        rest, name, data = b"", b"", None
        while True:
            if chunked:
                size_line = await timed(reader.readline())
                if not size_line.strip():
                    raise asyncio.IncompleteReadError(size_line, None)  # closed mid-stream
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    return
                got = (await timed(reader.readexactly(size + 2)))[:-2]
            else:
                got = await timed(reader.read(65536))
                if not got:
                    return
            *lines, rest = (rest + got).split(b"\n")
            events = []
            for line in lines:
                line = line.rstrip(b"\r")
                if not line:
                    if data is not None:
                        events.append((name, data))
                    name, data = b"", None
                elif line.startswith(b"data:"):
                    value = line[5:].removeprefix(b" ")
                    data = value if data is None else data + b"\n" + value
                elif line.startswith(b"event:"):
                    name = line[6:].strip()
            if events:
                yield events
    finally:
        writer.close()


async def post_sse_data(url: str, path: str, body: bytes, timeout: float) -> AsyncIterator[bytes]:
    """POST a JSON body and yield each SSE `data:` payload of the response as it arrives (`raw_events`)."""
    async with aclosing(raw_events(url, path, body, read_timeout=timeout)) as stream:
        async for events in stream:
            for _, data in events:
                yield data
