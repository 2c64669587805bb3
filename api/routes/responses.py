"""OpenAI's Responses API (api/responses.py): create (waited for, streamed, or in the background), retrieve
and resume its stream on any API process, cancel, delete, list its input items. A response that is not
background belongs to its connection, as OpenAI's: a client that goes away cancels it (stored, what it wrote
stays readable)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError

from api import models as served
from api import sse
from api.auth import Caller, CallerDep, release_stream_slot, require_stream_slot, stream_refused
from api.choices import failure, wait_all
from api.deps import RedisDep, RelayDep, SettingsDep, StoreDep
from api.errors import ApiError
from api.openai_schemas import Order, list_page
from api.quota import ThroughputDep, admit
from api.relay import Relay
from api.responses import (
    HEAD,
    ResponseRequest,
    ToolEvents,
    delta_event,
    head_events,
    job_id_of,
    tail_events,
)
from api.sse import EventStream
from api.store import JobStore
from api.streaming import SEQ_MAX, DoneEvent, TokenEvent, job_events
from api.validation import check_request
from shared.jobs import Job, JobStatus
from shared.openai_bodies import response_object
from shared.redis_client import UNAVAILABLE

log = logging.getLogger("conveyor.api")
router = APIRouter(prefix="/v1/responses", tags=["responses"])


def _not_found(resp_id: str) -> ApiError:
    return ApiError(404, f"no response with id '{resp_id}'", param="response_id")


async def _owned(store: JobStore, resp_id: str, caller: Caller) -> tuple[Job, dict[str, Any]]:
    """The caller's stored response (its job and the Responses API's part of the record); anything else 404s."""
    job_id = job_id_of(resp_id)
    job, raw = await store.get_with(job_id, "response") if job_id else (None, None)
    if job is None or not raw or not caller.owns(job):
        raise _not_found(resp_id)
    meta = orjson.loads(raw)
    if not meta.get("store", True):
        raise _not_found(resp_id)
    return job, meta


async def _conversation(store: JobStore, body: ResponseRequest, caller: Caller) -> list[dict[str, Any]]:
    """The earlier turns (from `previous_response_id`: its conversation and its answer, calls included), then
    this input."""
    before: list[dict[str, Any]] = []
    if body.previous_response_id:
        try:
            prev, meta = await _owned(store, body.previous_response_id, caller)
        except ApiError:  # as OpenAI answers it, which agents (Codex) recover from by sending the whole conversation
            raise ApiError(400, f"Previous response with id '{body.previous_response_id}' not found.",
                           param="previous_response_id", code="previous_response_not_found") from None
        if not prev.ended:
            raise ApiError(400, "the previous response has not finished", param="previous_response_id")
        answer: dict[str, Any] = {"role": "assistant", "content": prev.text}
        if prev.tool_calls:
            answer = {"role": "assistant", "content": prev.content or "", "tool_calls": prev.tool_calls}
        before = [*meta["conversation"], answer]
    return before + body.input_messages()


@router.post("", response_model=None)
async def create(body: ResponseRequest, request: Request, store: StoreDep, relay: RelayDep, settings: SettingsDep,
                 caller: CallerDep, throughput: ThroughputDep, redis: RedisDep,
                 idempotency_key: Annotated[str | None, Header(max_length=255)] = None) -> Any:
    """Create a response: answered when done, streamed (`stream`), or at once with status `queued` (`background`).
    A retry with the same `Idempotency-Key` (and body) is answered from the response the first made."""
    target = await served.resolve(redis, settings, body.model, caller.tenant)
    body.check()
    conversation = await _conversation(store, body, caller)
    gen = check_request(target.apply(body.generation(conversation), settings), settings,
                        {"max_tokens": "max_output_tokens"})
    meta_json = body.meta(conversation, settings.tool_call_parser if gen.calls_tools else None)
    slot = uuid.uuid4().hex
    if body.stream and not await require_stream_slot(redis, caller, slot):
        raise stream_refused(caller)
    try:
        job, replayed, limits = await admit(store, throughput, settings, caller, gen, idempotency_key,
                                            fields={"response": meta_json})
    except BaseException:
        if body.stream:
            await release_stream_slot(redis, caller, slot)
        raise
    meta = orjson.loads(meta_json)
    if replayed:
        limits = {**limits, "Idempotent-Replayed": "true"}
    if body.stream:
        async def close(reached_end: bool) -> None:
            if not reached_end and not body.background:  # it belongs to this connection
                await store.cancel(job.id, wait_s=0)
            if not body.store:
                await _discard(store, job.id)
            await release_stream_slot(redis, caller, slot)

        return EventStream(_events(store, relay, job, meta, -1, close), settings.sse_ping_s, limits)
    if body.background:
        return JSONResponse(response_object(job, meta), headers=limits)
    try:
        [end] = await wait_all(store, relay, [job], request)
        if end.status is JobStatus.failed and end.started_at is None:  # refused: the request's fault, as on chat
            raise failure(end)
        return JSONResponse(response_object(end, meta), headers=limits)
    finally:  # answered, refused or its client gone: nothing of it stays
        if not body.store:
            await asyncio.shield(_discard(store, job.id))


async def _discard(store: JobStore, job_id: str) -> None:
    """A `store: false` response's record and events, once its job has ended: a running one is cancelled first and
    waited for as a DELETE waits (its end gives back the tenant's unfinished-job slot). Left to its TTL when it does
    not end in that wait or Redis fails: a cleanup must not raise."""
    try:
        ended, _ = await store.cancel(job_id)  # (an ended job: nothing to cancel, answered as it is)
        if ended is not None and ended.ended:
            await store.delete(job_id)
    except (RedisError, *UNAVAILABLE) as exc:
        log.warning("response %s (store: false) is left to its TTL: %s", job_id, exc)


@router.get("/{response_id}", response_model=None)
async def retrieve(response_id: str, store: StoreDep, relay: RelayDep, settings: SettingsDep, caller: CallerDep,
                   redis: RedisDep, stream: bool = False,
                   starting_after: Annotated[int | None, Query(ge=-1, le=SEQ_MAX)] = None) -> Any:
    """The response as it stands; with `stream=true` its events after `starting_after` (a sequence number)."""
    job, meta = await _owned(store, response_id, caller)
    if not stream:
        return response_object(job, meta)
    slot = uuid.uuid4().hex
    if not await require_stream_slot(redis, caller, slot):
        raise stream_refused(caller)

    async def release(_: bool) -> None:
        await release_stream_slot(redis, caller, slot)

    after = -1 if starting_after is None else starting_after
    return EventStream(_events(store, relay, job, meta, after, release), settings.sse_ping_s)


@router.post("/{response_id}/cancel", response_model=None)
async def cancel(response_id: str, store: StoreDep, caller: CallerDep) -> Any:
    """Cancel a background response; cancelling one that has ended changes nothing (idempotent)."""
    job, meta = await _owned(store, response_id, caller)
    if not meta.get("background"):
        raise ApiError(400, "only a background response can be cancelled", param="response_id")
    if not job.ended:
        ended, _ = await store.cancel(job.id)
        job = ended or job
    return response_object(job, meta)


@router.delete("/{response_id}", response_model=None)
async def delete(response_id: str, store: StoreDep, caller: CallerDep) -> Any:
    """Delete a stored response. One still running is cancelled first and deleted once it has ended (its end gives
    back the tenant's unfinished-job slot, which a deleted record could not); a 409 to try again if that takes
    longer than the cancel's wait."""
    job, _ = await _owned(store, response_id, caller)
    if not job.ended:
        ended, _ = await store.cancel(job.id)
        if ended is not None and not ended.ended:
            raise ApiError(409, "the response is being cancelled; delete it again once it has ended",
                           headers={"Retry-After": "1"})
    await store.delete(job.id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.get("/{response_id}/input_items", response_model=None)
async def input_items(response_id: str, store: StoreDep, caller: CallerDep,
                      order: Order = "desc",
                      limit: Annotated[int, Query(ge=1, le=100)] = 20, after: str | None = None) -> Any:
    """The response's input items as OpenAI lists them (newest first unless `order=asc`, `limit` a page, from
    `after` an item's id): messages with their content parts, function calls and their outputs as given."""
    job, meta = await _owned(store, response_id, caller)
    items = [_input_item(job, i, item) for i, item in enumerate(meta["input"])]
    if order == "desc":
        items.reverse()
    if after is not None:
        at = next((k for k, item in enumerate(items) if item["id"] == after), None)
        if at is None:
            raise ApiError(404, f"no input item {after!r} in this response", param="after")
        items = items[at + 1:]
    return list_page(items[:limit], len(items) > limit)


def _input_item(job: Job, i: int, item: dict[str, Any]) -> dict[str, Any]:
    kind = item.get("type", "message")
    if kind != "message":  # function_call, function_call_output: as the client sent them
        return {**item, "id": item.get("id") or f"{kind[:2]}_{job.id.removeprefix('job_')}_{i}",
                "status": item.get("status", "completed")}
    role = item.get("role", "user")
    content = item.get("content")
    if isinstance(content, str):
        content = [{"type": "output_text" if role == "assistant" else "input_text", "text": content}]
    return {"id": item.get("id") or f"msg_{job.id.removeprefix('job_')}_{i}", "type": "message",
            "status": "completed", "role": role, "content": content or []}


async def _events(store: JobStore, relay: Relay, job: Job, meta: dict[str, Any], after: int,
                  on_close: Callable[[bool], Awaitable[None]]) -> AsyncIterator[bytes]:
    """The response's events with sequence_number > after: the opening four, a delta per job token event,
    the closing four. `on_close(reached_end)` runs, shielded, however the stream ends."""
    def frame(seq: int, kind: str, data: dict[str, Any]) -> bytes:
        return sse.encode(orjson.dumps({"type": kind, "sequence_number": seq, **data}), kind)

    reached_end = False
    try:
        if meta.get("tool_parser"):
            async for chunk in _tool_events(store, relay, job, meta, after, frame):
                if chunk is None:
                    reached_end = True
                else:
                    yield chunk
            return
        for seq, kind, data in head_events(job, meta):
            if seq > after:
                yield frame(seq, kind, data)
        try:
            # from three job events before the client's place: the closing events number on from the job's `done`, so
            # a client past the last delta (or at the very end) must meet that `done` again, not a made-up end at its
            # own place (the events it has are dropped below)
            async for ev in job_events(store, relay, job.id, max(0, after - (HEAD - 1) - 3)):
                if isinstance(ev, TokenEvent):
                    seq, kind, data = delta_event(job, ev.seq, ev.text, ev.logprobs)
                    if seq > after:
                        yield frame(seq, kind, data)
                elif isinstance(ev, DoneEvent):
                    for seq, kind, data in tail_events(ev.job, meta, ev.seq):
                        if seq > after:
                            yield frame(seq, kind, data)
                    reached_end = True
                    return
            yield _cut(relay)
        except RedisError:
            yield _cut(relay, store_down=True)
    finally:
        await asyncio.shield(on_close(reached_end))


async def _tool_events(store: JobStore, relay: Relay, job: Job, meta: dict[str, Any], after: int,
                       frame: Callable[[int, str, dict[str, Any]], bytes]) -> AsyncIterator[bytes | None]:
    """A response's events when its output may hold tool calls (api/responses.py `ToolEvents`): the job's events
    replayed from its start through the parser, those after `after` sent; None once the response has ended."""
    events = ToolEvents(job, meta)

    def fresh(evs: list[tuple[int, str, dict[str, Any]]]) -> list[bytes]:
        return [frame(seq, kind, data) for seq, kind, data in evs if seq > after]

    for chunk in fresh(events.head()):
        yield chunk
    try:
        async for ev in job_events(store, relay, job.id):
            if isinstance(ev, TokenEvent):
                for chunk in fresh(events.text(ev.text)):
                    yield chunk
            elif isinstance(ev, DoneEvent):
                for chunk in fresh(events.end(ev.job)):
                    yield chunk
                yield None
                return
        yield _cut(relay)
    except RedisError:
        yield _cut(relay, store_down=True)


def _cut(relay: Relay, store_down: bool = False) -> bytes:
    """The error event of a response's stream cut short: the store out of reach, the server stopping, or the
    response expired."""
    if store_down:
        message = "the response store is unavailable; resume with starting_after"
    elif relay.stopping:
        message = "the server is shutting down; resume with starting_after"
    else:
        message = "the response expired"
    return sse.encode(orjson.dumps({"type": "error", "code": "server_error", "message": message}), "error")
