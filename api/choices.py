"""An OpenAI request's choices: each choice of each prompt is a job of its own on the one job path
(`n` choices of `p` prompts are n x p jobs, index = prompt * n + choice). They are admitted together
(a refusal withdraws those already admitted), awaited together, and streamed as one merged stream;
a client that goes away cancels them all. Identical prompts share their prefill through the engine's
prefix cache."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from redis.exceptions import RedisError

from api.auth import Caller
from api.errors import ApiError
from api.quota import Throughput, admit
from api.relay import Relay
from api.store import JobStore
from api.streaming import DoneEvent, Event, StatusEvent, job_events
from shared.job_ops import CHARGED
from shared.jobs import Job, JobStatus
from shared.limits import SEED_MAX
from shared.schemas import GenerationRequest
from shared.settings import Settings


def failure(job: Job) -> ApiError:
    """A failed job as the OpenAI routes answer it: a 400 when it was refused before generation (the request
    itself was the problem: a prompt over the context, say), else a 503 to retry."""
    if job.started_at is None:
        return ApiError(400, job.error or "invalid request", type_="invalid_request_error")
    return ApiError(503, f"generation failed: {job.error or 'unknown error'}", type_="generation_failed",
                    headers={"Retry-After": "1"})


def choice_requests(prompts: list[GenerationRequest], n: int) -> list[GenerationRequest]:
    """Each prompt's request n times; a given seed becomes seed + choice, so every choice has its own
    seeded stream (without one, each job draws its own)."""
    out = []
    for req in prompts:
        for i in range(n):
            seed = None if req.seed is None else (req.seed + i) % (SEED_MAX + 1)
            out.append(req if i == 0 else req.model_copy(update={"seed": seed}))
    return out


async def admit_all(store: JobStore, throughput: Throughput, settings: Settings, caller: Caller,
                    requests: list[GenerationRequest]) -> tuple[list[Job], dict[str, str]]:
    """Admit every choice's job, or none: a refusal cancels those already admitted and is raised. The choices are
    one request of the key's: the first job takes it and every choice's tokens, having checked room for them all
    (submit.lua), so that a refusal mostly comes before any job; the rate-limit headers are the first job's."""
    jobs: list[Job] = []
    limits: dict[str, str] = {}
    whole = (sum(req.reserved_tokens() for req in requests), len(requests))
    try:
        for req in requests:
            job, _, headers = await admit(store, throughput, settings, caller, req,
                                          request=(CHARGED, 1) if jobs else whole)
            limits = limits or headers
            jobs.append(job)
    except BaseException:
        await asyncio.shield(cancel_all(store, jobs))
        raise
    return jobs, limits


async def cancel_all(store: JobStore, jobs: list[Job]) -> None:
    for job in jobs:
        try:
            await store.cancel(job.id, wait_s=0)
        except RedisError:
            pass  # it ends by itself; its slot frees at its max_tokens


async def wait_all(store: JobStore, relay: Relay, jobs: list[Job], request: Request) -> list[Job]:
    """Every job's end, in order; the client going away cancels them all (499)."""
    async def end_of(job_id: str) -> Job | None:
        async for ev in job_events(store, relay, job_id):
            if isinstance(ev, DoneEvent):
                return ev.job
        return None

    ends = await _each(store, jobs, request, end_of)
    if any(e is None for e in ends):
        raise ApiError(503, "the job expired before it ended")
    return ends  # type: ignore[return-value]


async def refused(store: JobStore, relay: Relay, jobs: list[Job], request: Request, wait_s: float) -> Job | None:
    """Before a stream's first byte: wait (at most `wait_s`) until each job has left the queue, and answer the
    first refused before it started (a prompt over the context, a grammar that does not compile: the request's
    fault, a 4xx rather than a stream that fails), else None. The client going away cancels them all (499)."""
    async def left_queue(job_id: str) -> Job | None:
        async for ev in job_events(store, relay, job_id, traced=False):  # (the relay span is the stream's)
            if isinstance(ev, StatusEvent) and not ev.job.ended and ev.job.started_at is None:
                continue
            return ev.job if isinstance(ev, DoneEvent) else None
        return None

    for job in await _each(store, jobs, request, left_queue, wait_s):
        if job is not None and job.status is JobStatus.failed and job.started_at is None:
            return job
    return None


async def _each(store: JobStore, jobs: list[Job], request: Request,
                until: Callable[[str], Coroutine[Any, Any, Job | None]],
                wait_s: float | None = None) -> list[Job | None]:
    """`until(job_id)` for every job, in order, at once (None for each not done within `wait_s`); the client going
    away cancels them all (499)."""
    tasks = [asyncio.create_task(until(j.id)) for j in jobs]
    loop = asyncio.get_running_loop()
    deadline = math.inf if wait_s is None else loop.time() + wait_s
    try:
        while True:
            _, pending = await asyncio.wait(tasks, timeout=min(0.25, max(0.0, deadline - loop.time())))
            if not pending or loop.time() >= deadline:
                return [t.result() if t.done() else None for t in tasks]
            if await request.is_disconnected():
                await cancel_all(store, jobs)
                raise ApiError(499, "client closed the request")
    except asyncio.CancelledError:
        await asyncio.shield(cancel_all(store, jobs))
        raise
    finally:
        for t in tasks:
            t.cancel()


@dataclass
class Cutoff:
    """A choice's stream ended before its job did (the server stopping, the job expiring, Redis down)."""
    error: RedisError | None = None


async def merged_events(store: JobStore, relay: Relay, jobs: list[Job]) -> AsyncIterator[tuple[int, Event | Cutoff]]:
    """Every job's events as (index, event), interleaved as they come; a job's stream ends with its
    DoneEvent, or a Cutoff when it is cut short."""
    queue: asyncio.Queue[tuple[int, Event | Cutoff]] = asyncio.Queue(maxsize=1024)

    async def pump(i: int, job_id: str) -> None:
        try:
            async for ev in job_events(store, relay, job_id):
                if isinstance(ev, StatusEvent):
                    continue
                await queue.put((i, ev))
                if isinstance(ev, DoneEvent):
                    return
            await queue.put((i, Cutoff()))
        except RedisError as exc:
            await queue.put((i, Cutoff(exc)))

    tasks = [asyncio.create_task(pump(i, j.id)) for i, j in enumerate(jobs)]
    try:
        open_ = len(jobs)
        while open_:
            i, ev = await queue.get()
            if isinstance(ev, (DoneEvent, Cutoff)):
                open_ -= 1
            yield i, ev
    finally:
        for t in tasks:
            t.cancel()
