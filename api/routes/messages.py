"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) on the same job path:
one job per request, admitted, limited and fairly shared as any job; it belongs to its request, so a client
that disconnects cancels it. Errors on these routes are in Anthropic's shape (api/errors.py); the
`anthropic-version` header is accepted and ignored."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError

from api import models as served
from api.anthropic import (
    ERRORS,
    CountTokensRequest,
    MessagesRequest,
    MessageStream,
    continues,
    error_event,
    message_body,
)
from api.auth import CallerDep, release_stream_slot, require_stream_slot, stream_refused
from api.choices import admit_all, cancel_all, refused, wait_all
from api.deps import RedisDep, RelayDep, SettingsDep, StoreDep
from api.errors import ApiError
from api.quota import ThroughputDep, take_request
from api.relay import Relay
from api.routes.tokenize import ask, bounded
from api.sse import EventStream
from api.store import JobStore
from api.streaming import DoneEvent, StatusEvent, TokenEvent, job_events
from api.validation import check_request
from shared.jobs import DamagedRecord, Job, JobStatus
from shared.tokenize_calls import TokenizeCall

router = APIRouter(prefix="/v1", tags=["anthropic"], responses=ERRORS)


def _failure(job: Job) -> ApiError:
    if job.started_at is None:  # refused before generation: the request itself was the problem
        return ApiError(400, job.error or "invalid request")
    return ApiError(500, f"generation failed: {job.error or 'unknown error'}")


def _unfinished(job: Job) -> ApiError | None:
    """A job that ended without its message, as the error it answers (None: its message is whole). Cancelled (by a
    `POST /v1/jobs/{id}/cancel` of its job) is no `end_turn`: Anthropic has no stop reason for it."""
    if job.status is JobStatus.failed:
        return _failure(job)
    if job.status is JobStatus.cancelled:
        return ApiError(409, "the message's generation was cancelled before it ended")
    return None


@router.post("/messages", response_model=None)
async def create_message(body: MessagesRequest, request: Request, store: StoreDep, relay: RelayDep,
                         settings: SettingsDep, caller: CallerDep, throughput: ThroughputDep) -> Any:
    """Anthropic's Messages API, streaming or not."""
    client = request.app.state.redis
    target = await served.resolve(client, settings, body.model, caller.tenant)
    # (checking tools' schemas is CPU work: off the event loop every request shares)
    req = check_request(target.apply(await asyncio.to_thread(body.to_generation), settings), settings)
    slot = uuid.uuid4().hex
    if body.stream and not await require_stream_slot(client, caller, slot):
        raise stream_refused(caller)
    try:
        jobs, limits = await admit_all(store, throughput, settings, caller, [req])
    except BaseException:
        if body.stream:
            await release_stream_slot(client, caller, slot)
        raise
    if body.stream:
        ended: list[bool] = []
        try:
            refusal = await refused(store, relay, jobs, request, settings.sse_ping_s)
        except BaseException:
            await release_stream_slot(client, caller, slot)
            raise
        if refusal is not None:
            await release_stream_slot(client, caller, slot)
            raise _failure(refusal)

        async def close() -> None:
            if not ended:
                await cancel_all(store, jobs)
            await release_stream_slot(client, caller, slot)

        parser = settings.tool_call_parser if req.calls_tools else None
        return EventStream(_closing(_stream(store, relay, jobs[0], parser), ended, close),
                           settings.sse_ping_s, limits)
    end = (await wait_all(store, relay, jobs, request))[0]
    err = _unfinished(end)
    if err is not None:
        raise err
    return JSONResponse(message_body(end), headers=limits)


@router.post("/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, client: RedisDep, relay: RelayDep, settings: SettingsDep,
                       caller: CallerDep, response: Response) -> dict[str, int]:
    """The prompt's tokens as a Messages request with this body would count them (the chat template's)."""
    target = await served.resolve(client, settings, body.model, caller.tenant)
    body.refuse_unsupported()
    messages = body.chat()
    prefill = continues(messages)  # continued, as /v1/messages does
    call = TokenizeCall(kind="tokenize", messages=messages, tools=body.prompt_tools(), add_special_tokens=False,
                        add_generation_prompt=not prefill, continue_final_message=prefill,
                        base_model=target.key(settings))
    bounded(call, settings.max_prompt_chars)
    await take_request(client, caller, response)
    reply = await ask(client, relay, call)
    return {"input_tokens": len(reply.tokens or [])}


async def _closing(frames: AsyncIterator[tuple[bytes, bool]], ended: list[bool],
                   close: Callable[[], Awaitable[None]]) -> AsyncIterator[bytes]:
    """The frames; `close` runs, shielded, however the stream ends (the client gone included): it cancels the
    job unless it ended."""
    try:
        async for frame, done in frames:
            if done and not ended:
                ended.append(True)
            yield frame
    finally:
        await asyncio.shield(close())


async def _input_tokens(store: JobStore, job_id: str) -> int:
    try:
        job = await store.get(job_id)
    except DamagedRecord:
        return 0
    return job.usage.prompt_tokens if job is not None else 0


async def _stream(store: JobStore, relay: Relay, job: Job,
                  tool_parser: str | None) -> AsyncIterator[tuple[bytes, bool]]:
    """Anthropic's events for the job, opened at its first event (its prompt counted by then); an error event
    when it fails, is cancelled or its stream is cut short. Yields (frame, whether the job has ended)."""
    message = MessageStream(job, tool_parser)
    opened = False
    try:
        async for ev in job_events(store, relay, job.id):
            if isinstance(ev, StatusEvent):
                continue
            err = _unfinished(ev.job) if isinstance(ev, DoneEvent) else None
            if err is not None:
                yield error_event(err.status, err.message), True
                return
            if not opened:
                opened = True
                for frame in message.start(await _input_tokens(store, job.id)):
                    yield frame, False
            if isinstance(ev, TokenEvent):
                for frame in message.text(ev.text):
                    yield frame, False
                continue
            for frame in message.end(ev.job):
                yield frame, True
            return
    except RedisError:
        pass
    yield error_event(503, "the stream ended before the message did (the server stopping, or the job "
                           "store out of reach); send the request again"), False
