"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from api.deps import RedisDep, SettingsDep
from api.guard import on_internal_port
from shared import __version__, names
from shared.pool_fault import read_faults
from shared.signals import aread_live

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@router.get("/version")
async def version() -> dict[str, str]:
    """The server's version (as vLLM's /version)."""
    return {"version": __version__}


@router.get("/health")
async def health(redis: RedisDep, request: Request, settings: SettingsDep) -> JSONResponse:
    """Ready or not, as vLLM, TGI and SGLang name it (load tools check it): 200 or 503."""
    return await readyz(redis, request, settings)


@router.get("/readyz")
async def readyz(redis: RedisDep, request: Request, settings: SettingsDep, pools: bool = True) -> JSONResponse:
    """Ready when Redis answers and each pool has a live worker; with `pools=false`, when Redis answers (an API
    process can take jobs, which wait queued for a worker: the readiness of an API pod behind a Service, which
    must not turn the door, and the autoscaler's /scaling behind it, away while a pool starts). When keys are
    required, the public port says only ready or not; the internal port adds the details."""
    answer = await _readiness(redis, settings, pools)
    if settings.auth_required and not on_internal_port(request.scope, settings.internal_port_number):
        body = {"status": answer.status_code == 200 and "ready" or "not_ready"}
        return JSONResponse(body, answer.status_code, headers={"Retry-After": "2"} if answer.status_code != 200
                            else None)
    return answer


async def _readiness(redis: RedisDep, settings: SettingsDep, pools_too: bool = True) -> JSONResponse:
    """Ready when Redis answers and every pool that is never empty has a live worker: with INFERENCE_MIN=0 the
    inference pool may be at zero (or a model's whose `min_replicas` is 0), and a job waits, queued, until a worker
    starts."""
    try:
        pools = {pool: len(ids) for pool, ids in (await aread_live(redis, names.pools(settings.model_keys))).items()}
        faults = await read_faults(redis, names.pools(settings.model_keys))
    except Exception as exc:  # noqa: BLE001 - any failure means not ready
        return JSONResponse({"status": "unavailable", "redis": False, "error": type(exc).__name__}, 503,
                            headers={"Retry-After": "2"})
    may_be_empty = {names.inference_pool(settings.key_of(m)) for m in settings.served if settings.bounds_of(m)[0] == 0}
    ready = not pools_too or all(n or pool in may_be_empty for pool, n in pools.items())
    body: dict[str, object] = {"status": "ready" if ready else "not_ready", "redis": True, "workers": pools}
    if faults:  # why a pool's latest worker failed to start (shared/pool_fault.py)
        body["faults"] = {pool: {"reason": f.reason, "failures": f.failures, "at": f.at} for pool, f in faults.items()}
    return JSONResponse(body, 200 if ready else 503)
