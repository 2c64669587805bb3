"""Typed dependencies: the settings, the Redis pool, the job store and the relay of this process.

They are `async def` on purpose: FastAPI runs a plain `def` dependency in its thread pool, a thread
hand-off per request per dependency (at 1,000 requests/s that was a sixth of the event loop's time)."""

from __future__ import annotations

from typing import Annotated

import redis.asyncio as aredis
from fastapi import Depends, Request

from api.relay import Relay
from api.store import JobStore
from shared.settings import Settings


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings  # type: ignore[no-any-return]


async def get_redis(request: Request) -> aredis.Redis:
    return request.app.state.redis  # type: ignore[no-any-return]


async def get_store(request: Request) -> JobStore:
    return request.app.state.store  # type: ignore[no-any-return]


async def get_relay(request: Request) -> Relay:
    return request.app.state.relay  # type: ignore[no-any-return]


SettingsDep = Annotated[Settings, Depends(get_settings)]
RedisDep = Annotated[aredis.Redis, Depends(get_redis)]
StoreDep = Annotated[JobStore, Depends(get_store)]
RelayDep = Annotated[Relay, Depends(get_relay)]
