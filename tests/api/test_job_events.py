"""A job's events as the API reads them (api/streaming.py), against a real redis-server: the event stream and the
job's channel written as the output lane writes them, by hand, so that the order of a replay and a publish is
chosen. The catch-up timer (CATCH_UP_S) is made longer than the test: an event that waits for it fails the test."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import orjson
import pytest

from api import streaming
from api.relay import Relay
from api.store import JobStore
from api.streaming import DoneEvent, TokenEvent, job_events
from shared import names
from shared.events import token_message
from shared.jobs import JobStatus, new_record
from shared.redis_client import async_client
from shared.settings import Settings


@pytest.fixture
async def parts(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[JobStore, Relay]]:
    monkeypatch.setattr(streaming, "CATCH_UP_S", 600.0)
    client = async_client(redis_url)
    relay = Relay(client, 256)
    await relay.start(5.0)
    yield JobStore(client, Settings(redis_url=redis_url)), relay
    await relay.stop()
    await client.aclose()  # type: ignore[attr-defined]


async def _job(store: JobStore, status: JobStatus) -> str:
    job_id = names.job_id_in(0, uuid.uuid4().hex)
    record = new_record(job_id, "m", "{}") | {"status": status.value}
    await store.r.hset(names.job_key(job_id), mapping=record)
    return job_id


async def _tokens(store: JobStore, job_id: str, seqs: range, publish: bool = False) -> None:
    for seq in seqs:
        await store.r.xadd(names.events_key(job_id), {"type": "token", "text": f"<{seq}>"}, id=f"0-{seq}")
        if publish:
            await store.r.publish(names.job_channel(job_id), token_message(seq, f"<{seq}>", None))


async def _end(store: JobStore, job_id: str, seq: int) -> None:
    """Its `done` entry and message, and its record ended, as finish.lua writes them."""
    await store.r.xadd(names.events_key(job_id), {"type": "done"}, id=f"0-{seq}")
    await store.r.hset(names.job_key(job_id), "status", JobStatus.succeeded.value)
    await store.r.publish(names.job_channel(job_id), orjson.dumps({"seq": seq, "type": "done"}))


async def _all(store: JobStore, relay: Relay, job_id: str, after: int = 0) -> list[int]:
    seqs = []
    async with asyncio.timeout(60):
        async for ev in job_events(store, relay, job_id, after):
            assert isinstance(ev, (TokenEvent, DoneEvent))
            seqs.append(ev.seq)
    return seqs


async def test_a_replay_longer_than_a_page_goes_on_at_once(parts: tuple[JobStore, Relay]) -> None:
    """2,500 events of an ended job, from several points: each page read as soon as the last was sent, not after a
    silence."""
    store, relay = parts
    job_id = await _job(store, JobStatus.running)
    await _tokens(store, job_id, range(1, 2501))
    await _end(store, job_id, 2501)
    for after in (0, 999, 1000, 2400):
        assert await _all(store, relay, job_id, after) == list(range(after + 1, 2502))


async def test_what_is_published_while_the_replay_is_read_is_not_dropped(parts: tuple[JobStore, Relay],
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The job's last events and its end come while its replay is being read: they are heard, in order, once."""
    store, relay = parts
    job_id = await _job(store, JobStatus.running)
    await _tokens(store, job_id, range(1, 4))
    read = store.read_events
    calls = 0

    async def slow_first_read(jid: str, after: int, count: int = 1000) -> list[tuple[int, str, str, str]]:
        nonlocal calls
        calls += 1
        replay = await read(jid, after, count)
        if calls == 1:  # the rest of the job happens between the read and the replay's sending: heard by the relay
            await _tokens(store, job_id, range(4, 7), publish=True)
            await _end(store, job_id, 7)
            [sub] = relay.subs[job_id]
            async with asyncio.timeout(30):
                while len(sub.items) < 4:
                    await asyncio.sleep(0.01)
        return replay

    monkeypatch.setattr(store, "read_events", slow_first_read)
    assert await _all(store, relay, job_id) == [1, 2, 3, 4, 5, 6, 7]


async def test_a_resume_point_past_a_running_jobs_end_gets_done_as_it_ends(parts: tuple[JobStore, Relay],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A client resuming past where a running job will end (a seq it never sent, or a stale one) hears nothing until
    the end, then `done` at once: the end's own seq is below the resume point, and was dropped with the tokens."""
    store, relay = parts
    job_id = await _job(store, JobStatus.running)
    await _tokens(store, job_id, range(1, 3))
    read = store.read_events
    live = asyncio.Event()

    async def noting_reads(jid: str, after: int, count: int = 1000) -> list[tuple[int, str, str, str]]:
        got = await read(jid, after, count)
        live.set()  # (its replay read: from here on what is published is heard live)
        return got

    monkeypatch.setattr(store, "read_events", noting_reads)
    stream = asyncio.create_task(_all(store, relay, job_id, after=5000))
    await live.wait()
    await asyncio.sleep(0)
    await _tokens(store, job_id, range(3, 5), publish=True)
    await _end(store, job_id, 5)
    assert await stream == [5000]  # its `done`, at the client's resume point


async def test_a_resume_point_past_any_seq_is_refused(app_client) -> None:  # type: ignore[no-untyped-def]
    """An event seq is at most 2**63 - 1: a resume point past it is a 4xx at once, not retries against the event
    stream ending in "the job store is unavailable"."""
    job = (await app_client.post("/v1/jobs", json={"prompt": "Hi", "max_tokens": 4})).json()
    url = f"/v1/jobs/{job['id']}/events"
    refused = [await app_client.get(url, headers={"Last-Event-ID": str(2**64)}),
               await app_client.get(url, params={"after": 2**64}),
               await app_client.get(url, headers={"Last-Event-ID": "next"})]
    assert [r.status_code for r in refused] == [400, 422, 400], [r.text for r in refused]
    assert "2**63" not in refused[0].text and str(streaming.SEQ_MAX) in refused[0].text
