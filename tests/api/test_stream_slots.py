"""A key's open-stream slots (`max_streams`) against a real redis-server: a slot's lease is renewed while its stream
stays open, so a stream longer than a lease keeps counting; one whose API process died lapses within one lease
(STREAM_LEASE_S), not an hour; a slot released is not brought back by a renewal under way."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest

from api.auth import Caller, release_stream_slot, renew_stream_leases, require_stream_slot
from shared import names
from shared.redis_client import async_client
from shared.tenants import STREAM_LEASE_S, Tenant


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[object]:
    c = async_client(redis_url)
    yield c
    await c.aclose()  # type: ignore[attr-defined]


def _caller(limit: int) -> Caller:
    return Caller(Tenant(f"slots-{uuid.uuid4().hex[:8]}", rpm=0, tpm=0, max_queued=0, max_streams=limit,
                         batch_tpm=0, max_file_bytes=0, max_open_batches=0, max_batch_lines=0, disabled=False))


async def test_an_open_streams_lease_is_renewed_and_a_released_one_stays_released(client) -> None:  # type: ignore[no-untyped-def]
    assert STREAM_LEASE_S <= 120  # a dead process's slots come back within minutes
    caller = _caller(2)
    key = names.tenant_streams_key(caller.owner)
    assert await require_stream_slot(client, caller, "open") and await require_stream_slot(client, caller, "gone")
    first = await client.zscore(key, "open")
    await release_stream_slot(client, caller, "gone")
    renewer = asyncio.create_task(renew_stream_leases(client, every_s=0.05))
    try:
        async with asyncio.timeout(10):
            while await client.zscore(key, "open") <= first:
                await asyncio.sleep(0.05)
    finally:
        renewer.cancel()
    assert await client.zscore(key, "gone") is None  # not brought back
    assert await client.zscore(key, "open") <= time.time() + STREAM_LEASE_S
    await release_stream_slot(client, caller, "open")


async def test_a_dead_processs_slots_lapse_with_their_lease(client) -> None:  # type: ignore[no-untyped-def]
    """Slots nobody renews (their process gone): once their lease has run out, the key may open streams again."""
    caller = _caller(1)
    key = names.tenant_streams_key(caller.owner)
    await client.zadd(key, {"left-by-a-dead-process": time.time() - 1})  # its lease ran out
    assert await require_stream_slot(client, caller, "new")
    assert not await require_stream_slot(client, caller, "one-too-many")
    await release_stream_slot(client, caller, "new")
