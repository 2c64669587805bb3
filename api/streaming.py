"""A job's events, gap-free and without duplicates, from any point: subscribe first, replay
the event stream after `after`, then go live, dropping what was already sent (by seq).
Silence, a full queue or a gap all fall back to replaying from the event stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import orjson

from api.relay import Relay
from api.store import JobStore
from shared.jobs import Job

CATCH_UP_S = 5.0


@dataclass
class TokenEvent:
    seq: int
    text: str


@dataclass
class DoneEvent:
    seq: int
    job: Job


@dataclass
class StatusEvent:
    job: Job


Event = TokenEvent | DoneEvent | StatusEvent


async def job_events(store: JobStore, relay: Relay, job_id: str, after: int = 0) -> AsyncIterator[Event]:
    sub = await relay.subscribe(job_id)
    last = after
    status_sent: tuple[str, int | None] | None = None
    try:
        while True:
            for seq, kind, text in await store.read_events(job_id, last):
                if kind == "done":
                    job = await store.get(job_id)
                    if job is not None:
                        yield DoneEvent(seq, job)
                    return
                last = seq
                yield TokenEvent(seq, text)
            sub.reset()
            if last == 0:
                job = await store.get(job_id)
                if job is None:
                    return
                if job.status.value == "queued":
                    job.queue_position = await store.queue_position(job_id)
                key = (job.status.value, job.queue_position)
                if key != status_sent and not job.ended:
                    status_sent = key
                    yield StatusEvent(job)
            while True:
                try:
                    data = await asyncio.wait_for(sub.queue.get(), CATCH_UP_S if last else 1.0)
                except TimeoutError:
                    break
                if sub.overflowed:
                    break
                msg = orjson.loads(data)
                seq = int(msg["seq"])
                if seq <= last:
                    continue
                if seq != last + 1:
                    break
                if msg["type"] == "done":
                    job = await store.get(job_id)
                    if job is not None:
                        yield DoneEvent(seq, job)
                    return
                last = seq
                yield TokenEvent(seq, msg["text"])
    finally:
        await relay.unsubscribe(sub)
