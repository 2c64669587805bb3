"""A job's events, gap-free and without duplicates, from any point, and the same as server-sent events
(`sse_job_events`, written by a `Framing`). Silence, a full queue, a relay reconnect or a gap all fall
back to replaying from the event stream.

A chunk's message on the job's channel is its seq, a newline, then its `token` event's data exactly as the job
API streams it (shared/events.py's `token_message`): the job API's framing forwards those bytes, and only a
framing that reshapes the event (OpenAI's, Responses') parses them. Any other message is a JSON object with
`seq` and `type` (finish.lua's `done`). A replayed chunk is read from the event stream's fields, and its data
written by `token_data`, byte for byte what the lane writes."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import orjson
from redis.exceptions import RedisError

from api import sse
from api.errors import error_body
from api.relay import Relay
from api.store import JobStore
from shared import tracing
from shared.events import token_data
from shared.jobs import DamagedRecord, Job
from shared.logprobs import Entry, parse_lines
from shared.retry import Backoff

log = logging.getLogger("conveyor.api")

CATCH_UP_S = 5.0  # silence this long: re-read the event stream (a lost message, a Redis restart)
REPLAY_PAGE = 1000  # events read from the event stream at a time
SEQ_MAX = 2**63 - 1  # the largest event seq a client may resume after (an event stream id's part is 64 bits)
QUEUED_POLL_S = 2.0  # while queued: how often the status and position are re-read for `status` events


class TokenEvent:
    """A chunk of the job's text: its seq, text and tokens' logprob entries (shared/logprobs.py; None when the
    job did not ask), and `data`, the job API's `token` event data. A live one comes as that data (nothing
    parses it unless its text is asked for), a replayed one as its fields (its data is written when asked)."""

    __slots__ = ("_data", "_logprobs", "_text", "seq")

    def __init__(self, seq: int, text: str | None = None, logprobs: list[Entry] | None = None,
                 data: bytes | None = None) -> None:
        self.seq, self._text, self._logprobs, self._data = seq, text, logprobs, data

    @property
    def data(self) -> bytes:
        if self._data is None:
            self._data = token_data(self.seq, self.text, self.logprobs)
        return self._data

    @property
    def text(self) -> str:
        if self._text is None:
            self._parse()
        return self._text or ""

    @property
    def logprobs(self) -> list[Entry] | None:
        if self._text is None:
            self._parse()
        return self._logprobs

    def _parse(self) -> None:
        event = orjson.loads(self.data)
        self._text = event["text"]
        items = event.get("logprobs")  # in the chat form: the entries back (their token ids are not needed)
        self._logprobs = None if items is None else [
            [None, i["token"], i["logprob"], [[None, t["token"], t["logprob"]] for t in i["top_logprobs"]]]
            for i in items]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TokenEvent) and (self.seq, self.data) == (other.seq, other.data)

    def __repr__(self) -> str:
        return f"TokenEvent({self.seq}, {self.text!r})"


@dataclass
class DoneEvent:
    seq: int
    job: Job


@dataclass
class StatusEvent:
    job: Job


Event = TokenEvent | DoneEvent | StatusEvent


async def job_events(store: JobStore, relay: Relay, job_id: str, after: int = 0,
                     traced: bool = True) -> AsyncIterator[Event]:
    """Events after `after`; a Redis error mid-stream is retried (with backoff) from the last seq sent. A job
    whose record turns out damaged (shared/jobs.py: `DamagedRecord`) ends its events as one that expired. A
    traced job's stream (every route's) is its `conveyor.relay` span, recorded when the stream ends (`traced`
    False: a look at its first events before its stream opens, no span of its own)."""
    last = after
    backoff = Backoff(0.1, 2.0)
    trace = await store.trace_of(job_id) if traced and tracing.enabled() else ""
    started, events, done = time.time(), 0, False
    try:
        while backoff.failures < 8:
            try:
                async for ev in _job_events(store, relay, job_id, last):
                    if isinstance(ev, (TokenEvent, DoneEvent)):
                        last = ev.seq
                    events += 1
                    done = isinstance(ev, DoneEvent)
                    yield ev
                return
            except RedisError:
                await asyncio.sleep(backoff.next())
            except DamagedRecord as exc:
                log.warning("%s: its events end here", exc)
                return
        raise RedisError("the job store stayed unavailable")
    finally:
        tracing.record("conveyor.relay", trace, started, time.time(),
                       {"conveyor.job.id": job_id, "conveyor.relay.events": events, "conveyor.relay.after": after,
                        "conveyor.relay.reached_done": done})


async def _job_events(store: JobStore, relay: Relay, job_id: str, after: int) -> AsyncIterator[Event]:
    """Subscribe first, replay the event stream after `after`, then go live, dropping what was already sent."""
    loop = asyncio.get_running_loop()
    sub = await relay.subscribe(job_id)
    last = after
    status_sent: tuple[str, int | None] | None = None
    try:
        while True:
            # what is published from here on is heard live; what was before is in the event stream, read now (the
            # lane writes an entry and publishes it in one call): a message that comes while the replay is read or
            # sent waits in the queue, not dropped
            sub.reset()
            events = await store.read_events(job_id, last, count=REPLAY_PAGE)
            for seq, kind, text, logprobs in events:
                if kind == "done":
                    job = await store.get(job_id)
                    if job is not None:
                        yield DoneEvent(seq, job)
                    return
                last = seq
                yield TokenEvent(seq, text, parse_lines(logprobs) if logprobs else None)
            if len(events) == REPLAY_PAGE:
                continue  # more to replay: the next page now, not after a silence
            if not events:
                job = await store.get(job_id)
                if job is None:
                    return
                if job.ended:  # nothing after `last` and the job is over: the client is at (or past) its end
                    if await store.read_events(job_id, last, count=1):
                        continue  # it ended just now: replay what came
                    yield DoneEvent(last, job)
                    return
                if last == 0:  # (an event replayed above leaves `last` past 0: seqs start at 1)
                    if job.status.value == "queued":
                        job.queue_position = await store.queue_position(job_id)
                    key = (job.status.value, job.queue_position)
                    if key != status_sent and not job.ended:
                        status_sent = key
                        yield StatusEvent(job)
            while True:
                if sub.items:
                    data = sub.items.popleft()
                elif relay.stopping:
                    return  # the server is shutting down: the client resumes elsewhere from `last`
                else:  # the relay wakes us with None after this long without news
                    queued = last == 0 and status_sent is not None and status_sent[0] == "queued"
                    sub.wake_at = loop.time() + (QUEUED_POLL_S if queued else CATCH_UP_S)
                    data = await sub.get()
                    sub.wake_at = math.inf
                if data is None or sub.overflowed:
                    break
                seq, token = _message(data)
                if token is None and seq <= last:
                    break  # its end, before the client's resume point: read again, which answers `done` at once
                if seq <= last:
                    continue
                if seq != last + 1:
                    break
                if token is None:  # done
                    job = await store.get(job_id)
                    if job is not None:
                        yield DoneEvent(seq, job)
                    return
                last = seq
                yield token
    finally:
        await relay.unsubscribe(sub)


def _message(data: bytes) -> tuple[int, TokenEvent | None]:
    """A message of the job's channel: (its seq, the chunk), or (seq, None) for its `done`."""
    if data[:1] != b"{":
        nl = data.index(b"\n")
        seq = int(data[:nl])
        return seq, TokenEvent(seq, data=data[nl + 1:])
    msg = orjson.loads(data)  # finish.lua's done; a chunk of this JSON form is published by older workers
    seq = int(msg["seq"])
    return seq, (None if msg["type"] == "done" else TokenEvent(seq, msg["text"], msg.get("logprobs")))


class Cut(Enum):
    """Why a job's stream ends before the job does."""

    EXPIRED = "expired"
    STOPPING = "stopping"
    STORE_DOWN = "store_down"


class Framing(Protocol):
    """How one job's events are written as server-sent events."""

    def opening(self) -> bytes | None: ...

    def token(self, ev: TokenEvent) -> bytes: ...

    def status(self, ev: StatusEvent) -> bytes | None: ...

    def done(self, ev: DoneEvent) -> tuple[bytes, ...]: ...

    def cut(self, why: Cut) -> bytes | None:
        """The last event of a stream cut short; None sends nothing, and lets a store failure propagate."""


@dataclass(frozen=True)
class JobFraming:
    """The job API's events: `token` ({seq, text}, id = seq), `status` while queued, `done` (the job,
    id = seq), or an `error` with the status and message `cuts` gives."""

    cuts: Mapping[Cut, tuple[int, str]]

    def opening(self) -> None:
        return None

    def token(self, ev: TokenEvent) -> bytes:
        return sse.encode(ev.data, "token", ev.seq)

    def status(self, ev: StatusEvent) -> bytes:
        return sse.encode(ev.job.model_dump_json(), "status")

    def done(self, ev: DoneEvent) -> tuple[bytes, ...]:
        return (sse.encode(ev.job.model_dump_json(), "done", ev.seq),)

    def cut(self, why: Cut) -> bytes:
        status, message = self.cuts[why]
        return sse.encode(orjson.dumps(error_body(status, message)), "error")


async def sse_job_events(store: JobStore, relay: Relay, job_id: str, framing: Framing, after: int = 0,
                         on_close: Callable[[bool], Awaitable[None]] | None = None) -> AsyncIterator[bytes]:
    """The job's events after `after` as `framing` writes them, ending with its `done` or `cut` events;
    `on_close(reached_done)` runs, shielded, however the stream ends (a client gone included)."""
    reached_done = False
    try:
        if (head := framing.opening()) is not None:
            yield head
        try:
            async for ev in job_events(store, relay, job_id, after):
                if isinstance(ev, TokenEvent):
                    yield framing.token(ev)
                elif isinstance(ev, StatusEvent):
                    if (frame := framing.status(ev)) is not None:
                        yield frame
                else:
                    reached_done = True
                    for frame in framing.done(ev):
                        yield frame
                    return
            last = framing.cut(Cut.STOPPING if relay.stopping else Cut.EXPIRED)
        except RedisError:
            last = framing.cut(Cut.STORE_DOWN)
            if last is None:
                raise
        if last is not None:
            yield last
    finally:
        if on_close is not None:
            await asyncio.shield(on_close(reached_done))
