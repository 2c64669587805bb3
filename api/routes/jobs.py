"""The job API: submit, poll, stream, cancel."""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Response

from api import models as served
from api.auth import Caller, CallerDep, release_stream_slot, require_stream_slot, stream_refused
from api.deps import RedisDep, RelayDep, SettingsDep, StoreDep
from api.errors import ApiError, ErrorResponse, not_found
from api.quota import ThroughputDep, admit
from api.sse import EventStream
from api.streaming import SEQ_MAX, Cut, JobFraming, sse_job_events
from api.validation import check_request
from shared.jobs import Job
from shared.schemas import GenerationRequest

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

# one server-sent event as clients parse it: `token` ({seq, text}), `status` and `done` (the job), `error`
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"event": {"type": "string", "enum": ["token", "status", "done", "error"]},
                             "id": {"type": "string"}, "data": {"type": "string"}}}
_NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"model": ErrorResponse, "description": "No such job"}}
_JOB_ID = {"job_id": "$response.body#/id"}
# OpenAPI links: where a submitted job's id leads (clients and schema-driven tools follow them)
_LINKS = {"PollJob": {"operationId": "poll_job", "parameters": _JOB_ID},
          "StreamJob": {"operationId": "stream_job", "parameters": _JOB_ID},
          "CancelJob": {"operationId": "cancel_job", "parameters": _JOB_ID}}
_FRAMING = JobFraming({Cut.EXPIRED: (404, "the job expired"),
                       Cut.STOPPING: (503, "the server is shutting down; reconnect with Last-Event-ID"),
                       Cut.STORE_DOWN: (503, "the job store is unavailable; reconnect with Last-Event-ID")})


async def get_job_or_404(store: StoreDep, job_id: str, caller: Caller) -> Job:
    """The caller's job; another tenant's job is as absent as one that never was."""
    job = await store.get(job_id)
    if job is None or not caller.owns(job):
        raise not_found(job_id)
    if job.status.value == "queued":
        job.queue_position = await store.queue_position(job_id)
    return job


@router.post("", status_code=202, response_model=Job, operation_id="submit_job",
             responses={202: {"description": "Accepted", "links": _LINKS}})
async def submit(body: GenerationRequest, response: Response, store: StoreDep, settings: SettingsDep,
                 caller: CallerDep, throughput: ThroughputDep, redis: RedisDep,
                 idempotency_key: Annotated[str | None, Header(max_length=255)] = None) -> Job:
    """Submit a generation job; poll it at Location or stream it from Location/events."""
    (await served.resolve(redis, settings, body.model, caller.tenant)).apply(body, settings)
    job, replayed, limits = await admit(store, throughput, settings, caller, check_request(body, settings),
                                        idempotency_key)
    response.headers.update(limits)
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    if replayed:
        response.headers["Idempotent-Replayed"] = "true"
    return job


@router.get("/{job_id}", response_model=Job, operation_id="poll_job", responses=_NOT_FOUND)
async def poll(job_id: str, store: StoreDep, caller: CallerDep) -> Job:
    """The job as it stands: status, text so far, usage, timestamps."""
    return await get_job_or_404(store, job_id, caller)


@router.post("/{job_id}/cancel", response_model=Job, operation_id="cancel_job",
             responses={**_NOT_FOUND, 409: {"model": ErrorResponse, "description": "The job has already ended"}})
async def cancel(job_id: str, store: StoreDep, caller: CallerDep) -> Job:
    """Cancel a queued or running job; 409 if it has already ended."""
    if caller.tenant is not None and await store.owner_of(job_id) != caller.owner:
        raise not_found(job_id)
    job, changed = await store.cancel(job_id)
    if job is None:
        await store.get(job_id)  # a damaged record is answered as one (DamagedRecord, api/errors.py)
        raise not_found(job_id)
    if not changed:
        raise ApiError(409, f"job {job_id} has already ended ({job.status.value})")
    return job


@router.get("/{job_id}/events", operation_id="stream_job",
            responses={**_NOT_FOUND, 200: {"description": "Server-sent events",
                                           "content": {"text/event-stream": {"schema": _SSE_EVENT}}}})
async def events(job_id: str, store: StoreDep, relay: RelayDep, settings: SettingsDep, caller: CallerDep,
                 redis: RedisDep, after: Annotated[int | None, Query(ge=0, le=SEQ_MAX)] = None,
                 last_event_id: Annotated[str | None, Header()] = None) -> EventStream:
    """Server-sent events: `token` per chunk (id = seq), `status` while queued, then `done`.
    Resume with Last-Event-ID or ?after= (both: the later, as a browser's EventSource resends the URL it opened
    with its Last-Event-ID)."""
    await get_job_or_404(store, job_id, caller)
    start = max(after or 0, _parse_seq(last_event_id))
    slot = uuid.uuid4().hex
    if not await require_stream_slot(redis, caller, slot):
        raise stream_refused(caller)

    async def release(_: bool) -> None:
        await release_stream_slot(redis, caller, slot)

    return EventStream(sse_job_events(store, relay, job_id, _FRAMING, start, release), settings.sse_ping_s)


def _parse_seq(value: str | None) -> int:
    if not value:
        return 0
    try:
        seq = max(0, int(value))
    except ValueError:
        seq = -1
    if not 0 <= seq <= SEQ_MAX:
        raise ApiError(400, f"Last-Event-ID must be an event seq (an integer up to {SEQ_MAX})")
    return seq
