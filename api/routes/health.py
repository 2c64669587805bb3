"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from api.deps import RedisDep
from shared import names

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@router.get("/health")
async def health(redis: RedisDep) -> JSONResponse:
    """Ready or not, as vLLM, TGI and SGLang name it (load tools check it): 200 or 503."""
    return await readyz(redis)


@router.get("/readyz")
async def readyz(redis: RedisDep) -> JSONResponse:
    """Ready when Redis answers and each pool has a live worker."""
    pools: dict[str, int] = {}
    try:
        await redis.ping()
        for pool in names.POOLS:
            pools[pool] = len([k async for k in redis.scan_iter(match=names.heartbeat_pattern(pool), count=500)])
    except Exception as exc:  # noqa: BLE001 - any failure means not ready
        return JSONResponse({"status": "unavailable", "redis": False, "error": str(exc)}, 503,
                            headers={"Retry-After": "2"})
    ready = all(pools.values())
    return JSONResponse({"status": "ready" if ready else "not_ready", "redis": True, "workers": pools},
                        200 if ready else 503)
