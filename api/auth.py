"""Who is calling: the API key (`Authorization: Bearer <key>`, or Anthropic's `x-api-key: <key>`) as a `Caller`,
cached briefly, and the stream slots a tenant may hold. With AUTH off (the default on loopback) every caller is one
tenant without per-key limits."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Annotated, cast

import redis.asyncio as aredis
from fastapi import Depends, Request
from redis.exceptions import RedisError

from api.deps import SettingsDep
from api.errors import ApiError, too_many
from api.guard import bearer_of
from shared import names
from shared.job_ops import stream_open
from shared.jobs import Job
from shared.redis_client import text
from shared.scripts.codes import StreamOpenCode
from shared.tenants import STREAM_LEASE_S, STREAM_RENEW_S, Tenant, hash_key

CACHE_S = 2.0  # a revoked key stops working within this long
CACHE_MAX = 10_000


@dataclass(frozen=True)
class Caller:
    """The tenant behind a request, or None when auth is off."""

    tenant: Tenant | None

    @property
    def owner(self) -> str:
        return self.tenant.name if self.tenant else ""

    def owns(self, job: Job) -> bool:
        return self.tenant is None or job.owner == self.tenant.name


class KeyCache:
    """Key digest -> tenant, for a couple of seconds, so most requests spend no round trip on auth.
    Submits re-check the tenant inside the submit script."""

    def __init__(self, client: aredis.Redis) -> None:
        self.r = client  # a decoding client: replies are text
        self._entries: dict[str, tuple[float, Tenant | None]] = {}

    async def lookup(self, key: str) -> Tenant | None:
        digest = hash_key(key)
        now = time.monotonic()
        hit = self._entries.get(digest)
        if hit is not None and hit[0] > now:
            return hit[1]
        name = text(await self.r.get(names.api_key_index(digest)))
        tenant = None
        if name:
            rec = cast("dict[str, str]", await self.r.hgetall(names.tenant_key(name)))
            if rec and rec.get("key_sha256") == digest and rec.get("disabled") != "1":
                tenant = Tenant.from_record(name, rec)
        if len(self._entries) >= CACHE_MAX:
            self._entries.clear()
        self._entries[digest] = (now + CACHE_S, tenant)
        return tenant


def _bearer(request: Request) -> str | None:
    return bearer_of(request.headers.get("authorization", ""), request.headers.get("x-api-key", ""))





async def get_caller(request: Request, settings: SettingsDep) -> Caller:
    """The request's caller; 401 with a Bearer challenge when a required key is missing or unknown."""
    if not settings.auth_required:
        return Caller(None)
    key = _bearer(request)
    challenge = {"WWW-Authenticate": 'Bearer realm="conveyor"'}
    if key is None:
        raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                       code="missing_api_key",
                       headers=challenge)
    tenant = await request.app.state.keys.lookup(key)
    if tenant is None:
        raise ApiError(401, "invalid or revoked API key", code="invalid_api_key", headers=challenge)
    return Caller(tenant)


CallerDep = Annotated[Caller, Depends(get_caller)]


# this process's open streams' slots, by tenant: their leases (STREAM_LEASE_S) are renewed while they stay open
# (`renew_stream_leases`), so a slot outlives its stream by at most one lease when the process dies
log = logging.getLogger("conveyor.api")

_held: dict[str, set[str]] = {}


async def require_stream_slot(client: aredis.Redis, caller: Caller, stream_id: str) -> bool:
    """Take one of the tenant's stream slots; False when it has none free."""
    t = caller.tenant
    if t is None or t.max_streams <= 0:
        return True
    if await stream_open(client, t.name, stream_id, STREAM_LEASE_S, t.max_streams) is not StreamOpenCode.opened:
        return False
    _held.setdefault(t.name, set()).add(stream_id)
    return True


async def release_stream_slot(client: aredis.Redis, caller: Caller, stream_id: str) -> None:
    if caller.tenant is not None and caller.tenant.max_streams > 0:
        held = _held.get(caller.tenant.name)
        if held is not None:
            held.discard(stream_id)
            if not held:
                del _held[caller.tenant.name]
        await client.zrem(names.tenant_streams_key(caller.tenant.name), stream_id)


async def renew_stream_leases(client: aredis.Redis, every_s: float = STREAM_RENEW_S) -> None:
    """Every `every_s`, push the leases of this process's open streams a lease ahead (a task of the API's life)."""
    while True:
        await asyncio.sleep(every_s)
        held = {tenant: list(ids) for tenant, ids in _held.items() if ids}
        if not held:
            continue
        until = time.time() + STREAM_LEASE_S
        pipe = client.pipeline(transaction=False)
        for tenant, ids in held.items():
            key = names.tenant_streams_key(tenant)
            pipe.zadd(key, dict.fromkeys(ids, until), xx=True)  # (a slot released meanwhile stays released)
            pipe.expire(key, STREAM_LEASE_S)
        try:
            await pipe.execute()
        except RedisError as exc:  # the next round tries again; a lease runs out only after STREAM_LEASE_S
            log.warning("renewing %d stream leases failed: %s", sum(map(len, held.values())), exc)


def stream_refused(caller: Caller) -> ApiError:
    limit = caller.tenant.max_streams if caller.tenant else 0
    return too_many(f"this key has {limit} open streams, its limit; close one first", 5000)
