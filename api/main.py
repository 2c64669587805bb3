"""Assembles the API: routers, error handlers, and a lifespan that opens the Redis pool and relay."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.telemetry import TelemetryConfig

from api import dashboard, errors, metrics
from api import models as served
from api.auth import KeyCache, renew_stream_leases
from api.batches import Batches
from api.files import FileStore
from api.guard import RequestGuard
from api.quota import Throughput
from api.relay import Relay
from api.routes import batches, health, jobs, loras, messages, openai, responses, tokenize
from api.store import JobStore
from api.validation import document_bounds
from shared import tracing
from shared.limits import MAX_BODY_BYTES
from shared.redis_client import async_client
from shared.settings import Settings, get_settings


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        served.check_static(settings)  # as vLLM, a LORA_MODULES adapter that cannot be served stops the start
        client = async_client(settings.redis_url)
        app.state.settings = settings
        app.state.redis = client
        app.state.store = JobStore(client, settings)
        app.state.relay = Relay(client, settings.sse_queue_size)
        app.state.keys = KeyCache(client)
        app.state.throughput = Throughput(client, settings.model_keys)
        app.state.files = FileStore(client, settings.job_ttl_s + settings.batch_window_s)
        app.state.batches = Batches(client, app.state.files, settings)  # driven by the Celery worker
        await app.state.relay.start()
        app.state.throughput.start()
        leases = asyncio.create_task(renew_stream_leases(client), name="stream-leases")
        try:
            yield
        finally:
            leases.cancel()
            await app.state.throughput.stop()
            await app.state.relay.stop()
            await client.aclose()

    app = FastAPI(title="conveyor", version="0.1.0", lifespan=lifespan, responses=errors.COMMON_ERRORS,
                  description="LLM generation as a distributed worker system", telemetry=_telemetry())
    app.add_middleware(RequestGuard, max_body_bytes=MAX_BODY_BYTES,
                       internal_port=settings.internal_port_number if settings.auth_required else None,
                       keys_required=settings.auth_required)
    errors.install(app)
    app.include_router(health.router)
    app.include_router(jobs.router)
    app.include_router(openai.router)
    app.include_router(messages.router)
    app.include_router(tokenize.router)
    app.include_router(loras.router)
    app.include_router(responses.router)
    app.include_router(batches.router)
    app.include_router(metrics.router)
    app.include_router(dashboard.router)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = document_bounds(get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes), settings)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


# the requests FastAPI's own telemetry gives a server span (the client's `traceparent` its parent; current while
# the request is answered, so a job it submits is that span's child: shared.job_ops.new_job; ended with the
# response's last byte, so a stream's span covers the stream); probes and the operator's pages are not traced
TRACED = ("/v1/", "/tokenize", "/detokenize")


def _telemetry() -> TelemetryConfig:
    """FastAPI's telemetry settings: request spans only, and only when tracing is on (shared/tracing.py)."""
    on = tracing.setup("api")
    return {"tracing": on, "metrics": False, "logs": False, "operation_spans": False, "auto_configure": False,
            "exclude": lambda scope: not str(scope.get("path", "")).startswith(TRACED)}


app = create_app()
