"""The job API: submit, poll, stream, cancel."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

import orjson
from fastapi import APIRouter, Header, Query, Response
from redis.exceptions import RedisError

from api import sse
from api.deps import RelayDep, SettingsDep, StoreDep
from api.errors import ApiError, error_body
from api.sse import EventStream
from api.streaming import DoneEvent, StatusEvent, TokenEvent, job_events
from shared.jobs import Job
from shared.schemas import GenerationRequest
from shared.settings import Settings

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

def check_limits(req: GenerationRequest, settings: Settings) -> GenerationRequest:
    """Apply server defaults and caps that the schema cannot know."""
    if "max_tokens" not in req.model_fields_set:
        req.max_tokens = settings.default_max_tokens
    if req.max_tokens > settings.max_tokens_cap:
        raise ApiError(422, f"max_tokens must be at most {settings.max_tokens_cap}", param="max_tokens")
    if len(req.stop) > settings.max_stop_strings:
        raise ApiError(422, f"at most {settings.max_stop_strings} stop strings", param="stop")
    size = len(req.prompt or "") + sum(len(m.content) for m in req.messages or [])
    if size > settings.max_prompt_chars:
        raise ApiError(413, f"the prompt has {size} characters; the limit is {settings.max_prompt_chars}")
    return req


async def get_job_or_404(store: StoreDep, job_id: str) -> Job:
    job = await store.get(job_id)
    if job is None:
        raise ApiError(404, f"no job {job_id!r}")
    if job.status.value == "queued":
        job.queue_position = await store.queue_position(job_id)
    return job


@router.post("", status_code=202, response_model=Job)
async def submit(body: GenerationRequest, response: Response, store: StoreDep, settings: SettingsDep,
                 idempotency_key: Annotated[str | None, Header(max_length=255)] = None) -> Job:
    """Submit a generation job; poll it at Location or stream it from Location/events."""
    job, replayed = await store.submit(check_limits(body, settings), idempotency_key)
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    if replayed:
        response.headers["Idempotent-Replayed"] = "true"
    return job


@router.get("/{job_id}", response_model=Job)
async def poll(job_id: str, store: StoreDep) -> Job:
    """The job as it stands: status, text so far, usage, timestamps."""
    return await get_job_or_404(store, job_id)


@router.post("/{job_id}/cancel", response_model=Job)
async def cancel(job_id: str, store: StoreDep) -> Job:
    """Cancel a queued or running job; 409 if it has already ended."""
    job, changed = await store.cancel(job_id)
    if job is None:
        raise ApiError(404, f"no job {job_id!r}")
    if not changed:
        raise ApiError(409, f"job {job_id} has already ended ({job.status.value})")
    return job


def job_json(job: Job) -> str:
    return job.model_dump_json()


@router.get("/{job_id}/events")
async def events(job_id: str, store: StoreDep, relay: RelayDep, settings: SettingsDep,
                 after: Annotated[int | None, Query(ge=0)] = None,
                 last_event_id: Annotated[str | None, Header()] = None) -> EventStream:
    """Server-sent events: `token` per chunk (id = seq), `status` while queued, then `done`.
    Resume with Last-Event-ID or ?after=."""
    await get_job_or_404(store, job_id)
    start = after if after is not None else _parse_seq(last_event_id)

    async def stream() -> AsyncIterator[bytes]:
        try:
            async for ev in job_events(store, relay, job_id, start):
                if isinstance(ev, TokenEvent):
                    yield sse.encode(orjson.dumps({"seq": ev.seq, "text": ev.text}), "token", ev.seq)
                elif isinstance(ev, StatusEvent):
                    yield sse.encode(job_json(ev.job), "status")
                elif isinstance(ev, DoneEvent):
                    yield sse.encode(job_json(ev.job), "done", ev.seq)
                    return
            error = error_body(404, "the job expired")
        except RedisError:
            error = error_body(503, "the job store is unavailable; reconnect with Last-Event-ID")
        yield sse.encode(orjson.dumps(error), "error")

    return EventStream(stream(), settings.sse_ping_s)


def _parse_seq(value: str | None) -> int:
    if not value:
        return 0
    try:
        return max(0, int(value))
    except ValueError:
        raise ApiError(400, "Last-Event-ID must be an event seq (an integer)") from None
