"""OpenAI-compatible endpoints on the same job path. These jobs belong to their request:
a client that disconnects cancels its generation."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from api import sse
from api.auth import Caller, CallerDep, release_stream_slot, require_stream_slot, stream_refused
from api.deps import RelayDep, SettingsDep, StoreDep
from api.errors import ApiError, error_body
from api.openai_schemas import ChatCompletionRequest, CompletionRequest
from api.quota import Throughput, ThroughputDep, admit
from api.relay import Relay
from api.sse import EventStream
from api.store import JobStore
from api.streaming import Cut, DoneEvent, StatusEvent, TokenEvent, job_events, sse_job_events
from api.validation import check_request
from shared.jobs import Job, JobStatus
from shared.model_config import model_context
from shared.settings import Settings

router = APIRouter(prefix="/v1", tags=["openai"])


def _check_model(requested: str | None, settings: Settings) -> None:
    if requested and requested != settings.served_model_name:
        raise ApiError(404, f"the model '{requested}' does not exist; this server runs "
                            f"'{settings.served_model_name}'", type_="model_not_found", param="model")


def _usage(job: Job) -> dict[str, int]:
    return job.usage.model_dump()


def _finish(job: Job) -> str | None:
    return job.finish_reason.value if job.finish_reason else None


def _failure(job: Job) -> ApiError:
    if job.started_at is None:  # refused before generation: the request itself was the problem
        return ApiError(400, job.error or "invalid request", type_="invalid_request_error")
    return ApiError(503, f"generation failed: {job.error or 'unknown error'}", type_="generation_failed",
                    headers={"Retry-After": "1"})


@router.get("/models")
async def models(settings: SettingsDep, caller: CallerDep) -> dict[str, Any]:
    """The served model."""
    entry: dict[str, Any] = {"id": settings.served_model_name, "object": "model", "created": 0, "owned_by": "conveyor",
                             "root": settings.served_model_name}
    entry["max_model_len"] = model_context(settings.model_path, settings.max_model_len)  # as vLLM reports it
    return {"object": "list", "data": [entry]}


async def _wait_for_end(store: JobStore, relay: Relay, job_id: str, request: Request) -> Job:
    async def consume() -> Job | None:
        async for ev in job_events(store, relay, job_id):
            if isinstance(ev, DoneEvent):
                return ev.job
        return None

    task = asyncio.create_task(consume())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                job = task.result()
                if job is None:
                    raise ApiError(503, "the job expired before it ended")
                return job
            if await request.is_disconnected():
                await store.cancel(job_id, wait_s=0)
                raise ApiError(499, "client closed the request")
    except asyncio.CancelledError:
        await asyncio.shield(store.cancel(job_id, wait_s=0))
        raise
    finally:
        task.cancel()


Chunk = Callable[[Job, dict[str, Any], str, str | None], dict[str, Any]]


@dataclass(frozen=True)
class ChunkFraming:
    """OpenAI's stream: unnamed `data:` chunks (a role chunk first for chat), then the finish chunk, the
    usage chunk when asked for, and `data: [DONE]`; a cut stream ends with an error object instead."""

    job: Job
    chunk: Chunk
    role_chunk: bool
    include_usage: bool

    def opening(self) -> bytes | None:
        if not self.role_chunk:
            return None
        return sse.encode(orjson.dumps(self.chunk(self.job, {"role": "assistant", "content": ""}, "", None)))

    def token(self, ev: TokenEvent) -> bytes:
        return sse.encode(orjson.dumps(self.chunk(self.job, {"content": ev.text}, ev.text, None)))

    def status(self, ev: StatusEvent) -> None:
        return None

    def done(self, ev: DoneEvent) -> tuple[bytes, ...]:
        end = ev.job
        if end.status is JobStatus.failed:
            err = _failure(end)
            frames: list[dict[str, Any]] = [error_body(err.status, err.message, err.type)]
        else:
            frames = [self.chunk(self.job, {}, "", _finish(end))]
            if self.include_usage:
                frames.append({**self.chunk(self.job, {}, "", None), "choices": [], "usage": _usage(end)})
        return (*(sse.encode(orjson.dumps(f)) for f in frames), sse.encode("[DONE]"))

    def cut(self, why: Cut) -> bytes | None:
        """A stream cut short cannot resume elsewhere: an error object, without `[DONE]`; a store failure propagates."""
        if why is Cut.STORE_DOWN:
            return None
        return sse.encode(orjson.dumps(error_body(503, "the server is shutting down; the generation was cancelled")))


async def _serve(body: ChatCompletionRequest | CompletionRequest, request: Request, store: JobStore,
                 relay: Relay, settings: Settings, caller: Caller, throughput: Throughput, chat: bool) -> Any:
    """Both endpoints: one job, streamed as chunks or awaited; only the response shapes differ."""
    _check_model(body.model, settings)
    gen = check_request(body.to_generation(), settings)
    redis = request.app.state.redis
    slot = uuid.uuid4().hex
    if body.stream and not await require_stream_slot(redis, caller, slot):
        raise stream_refused(caller)
    try:
        job, _, limits = await admit(store, throughput, settings, caller, gen)
    except BaseException:
        if body.stream:
            await release_stream_slot(redis, caller, slot)
        raise
    created = int(time.time())
    cid = ("chatcmpl-" if chat else "cmpl-") + job.id.removeprefix("job_")
    obj = "chat.completion" if chat else "text_completion"

    def chunk(j: Job, delta: dict[str, Any], text: str, finish: str | None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta} if chat else {"index": 0, "text": text}
        return {"id": cid, "object": f"{obj}.chunk" if chat else obj, "created": created, "model": j.model,
                "choices": [{**choice, "logprobs": None, "finish_reason": finish}]}

    if body.stream:
        usage = bool(body.stream_options and body.stream_options.include_usage)
        framing = ChunkFraming(job, chunk, role_chunk=chat, include_usage=usage)

        async def close(reached_done: bool) -> None:
            if not reached_done:  # the client went away mid-stream: free the engine slot
                await store.cancel(job.id, wait_s=0)
            await release_stream_slot(redis, caller, slot)

        return EventStream(sse_job_events(store, relay, job.id, framing, on_close=close), settings.sse_ping_s, limits)
    end = await _wait_for_end(store, relay, job.id, request)
    if end.status is JobStatus.failed:
        raise _failure(end)
    choice = ({"index": 0, "message": {"role": "assistant", "content": end.text}} if chat
              else {"index": 0, "text": end.text})
    out = {"id": cid, "object": obj, "created": created, "model": end.model,
           "choices": [{**choice, "logprobs": None, "finish_reason": _finish(end)}], "usage": _usage(end)}
    if chat:
        out["system_fingerprint"] = None
    return JSONResponse(out, headers=limits)


@router.post("/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request, store: StoreDep, relay: RelayDep,
                           settings: SettingsDep, caller: CallerDep, throughput: ThroughputDep) -> Any:
    """OpenAI chat completions, streaming or not."""
    return await _serve(body, request, store, relay, settings, caller, throughput, chat=True)


@router.post("/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request, store: StoreDep, relay: RelayDep,
                      settings: SettingsDep, caller: CallerDep, throughput: ThroughputDep) -> Any:
    """OpenAI text completions, streaming or not."""
    return await _serve(body, request, store, relay, settings, caller, throughput, chat=False)
