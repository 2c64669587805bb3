"""Typed dependencies: the settings, the Redis pool, the job store and the relay of this process."""

from __future__ import annotations

from typing import Annotated

import redis.asyncio as aredis
from fastapi import Depends, Request

from api.relay import Relay
from api.store import JobStore
from shared.settings import Settings


def get_settings(request: Request) -> Settings:
    return request.app.state.settings  # type: ignore[no-any-return]


def get_redis(request: Request) -> aredis.Redis:
    return request.app.state.redis  # type: ignore[no-any-return]


def get_store(request: Request) -> JobStore:
    return request.app.state.store  # type: ignore[no-any-return]


def get_relay(request: Request) -> Relay:
    return request.app.state.relay  # type: ignore[no-any-return]


SettingsDep = Annotated[Settings, Depends(get_settings)]
RedisDep = Annotated[aredis.Redis, Depends(get_redis)]
StoreDep = Annotated[JobStore, Depends(get_store)]
RelayDep = Annotated[Relay, Depends(get_relay)]
