"""OpenAI-compatible endpoints on the same job path: a job per choice per prompt (api/choices.py). These
jobs belong to their request: a client that disconnects cancels its generations. The bodies an ended job
makes are shared/openai_bodies.py's."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from api import models as served
from api import sse
from api.auth import Caller, CallerDep, release_stream_slot, require_stream_slot, stream_refused
from api.choices import Cutoff, admit_all, cancel_all, choice_requests, failure, merged_events, refused, wait_all
from api.deps import RelayDep, SettingsDep, StoreDep
from api.errors import error_body
from api.openai_schemas import ChatCompletionRequest, CompletionRequest
from api.quota import Throughput, ThroughputDep
from api.relay import Relay
from api.sse import EventStream
from api.store import JobStore
from api.streaming import TokenEvent
from api.validation import check_request
from shared import tool_parsers
from shared.jobs import DamagedRecord, Job, JobStatus
from shared.logprobs import chat_item, completion_logprobs
from shared.openai_bodies import Shape, completion_id, completion_object, finish_reason, tool_call_delta, usage_of
from shared.settings import Settings
from shared.tool_parsers import CallStart, StreamEvent

router = APIRouter(prefix="/v1", tags=["openai"])


@router.get("/models")
async def models(request: Request, settings: SettingsDep, caller: CallerDep) -> dict[str, Any]:
    """The served models, then their LoRA adapters (`parent`: the model), each with its `max_model_len`, as vLLM
    lists them."""
    return {"object": "list", "data": await served.listing(request.app.state.redis, settings, caller.tenant)}


@router.get("/models/{model:path}")
async def model(model: str, request: Request, settings: SettingsDep, caller: CallerDep) -> dict[str, Any]:
    """One entry of /v1/models: a served model or an adapter the caller may name; 404 otherwise."""
    for entry in await served.listing(request.app.state.redis, settings, caller.tenant):
        if entry["id"] == model:
            return entry
    raise served.not_found(model, settings, caller.tenant)


async def _serve(body: ChatCompletionRequest | CompletionRequest, request: Request, store: JobStore,
                 relay: Relay, settings: Settings, caller: Caller, throughput: Throughput, chat: bool) -> Any:
    """Both endpoints: a job per choice per prompt, streamed as chunks or awaited; only the shapes differ."""
    target = await served.resolve(request.app.state.redis, settings, body.model, caller.tenant)
    sent_as = {"max_tokens": "max_completion_tokens"} if getattr(body, "max_completion_tokens", None) else None
    # (checking tools' and structured outputs' schemas is CPU work: off the event loop every request shares)
    generations = await asyncio.to_thread(body.to_generation)
    prompts = [check_request(target.apply(g, settings), settings, sent_as) for g in generations]
    runs = choice_requests(prompts, body.n)
    echo = bool(getattr(body, "echo", False))
    logprobs = bool(body.logprobs is not None and body.logprobs is not False)
    shape = Shape(chat, logprobs, echo, [r.prompt for r in runs])
    redis = request.app.state.redis
    slot = uuid.uuid4().hex
    if body.stream and not await require_stream_slot(redis, caller, slot):
        raise stream_refused(caller)
    try:
        jobs, limits = await admit_all(store, throughput, settings, caller, runs)
    except BaseException:
        if body.stream:
            await release_stream_slot(redis, caller, slot)
        raise
    created = int(time.time())
    cid = completion_id(chat, jobs[0].id)
    head = {"id": cid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": jobs[0].model}
    if body.stream:
        try:  # a choice refused before it started (its prompt over the context): a 400, as without a stream
            refusal = await refused(store, relay, jobs, request, settings.sse_ping_s)
            if refusal is not None:
                await cancel_all(store, jobs)
                raise failure(refusal)
        except BaseException:
            await release_stream_slot(redis, caller, slot)
            raise
        usage = bool(body.stream_options and body.stream_options.include_usage)
        parser = settings.tool_call_parser if runs[0].calls_tools else None
        frames = _stream(store, relay, jobs, shape, head, body.n, usage, parser)

        async def close() -> None:
            await cancel_all(store, [j for j in jobs if j.id not in finished])
            await release_stream_slot(redis, caller, slot)

        finished: set[str] = set()
        return EventStream(_closing(frames, finished, close), settings.sse_ping_s, limits)
    ends = await wait_all(store, relay, jobs, request)
    failed = next((e for e in ends if e.status is JobStatus.failed), None)
    if failed is not None:
        raise failure(failed)
    return JSONResponse(completion_object(cid, created, ends, shape, body.n), headers=limits)


async def _closing(frames: AsyncIterator[tuple[bytes, str | None]], finished: set[str],
                   close: Callable[[], Awaitable[None]]) -> AsyncIterator[bytes]:
    """The frames; `close` runs, shielded, however the stream ends (the client gone included): it cancels
    the jobs that did not end, freeing their engine slots."""
    try:
        async for frame, ended in frames:
            if ended:
                finished.add(ended)
            yield frame
    finally:
        await asyncio.shield(close())


class _Chunks:
    """An OpenAI stream's chunks: each a `data:` frame of the completion's head and its choices; with a tool parser,
    each choice's parser events as tool-call deltas, and whether the choice called a tool."""

    def __init__(self, head: dict[str, Any], jobs: list[Job], shape: Shape, tool_parser: str | None) -> None:
        self.head, self.jobs, self.shape = head, jobs, shape
        self.parsers = [tool_parsers.stream(tool_parser) for _ in jobs] if tool_parser else None
        self.called = [False] * len(jobs)

    def frame(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return sse.encode(orjson.dumps({**self.head, "choices": choices, **extra}))

    def tool_frames(self, i: int, events: list[StreamEvent], entries: list[Any] | None) -> list[bytes]:
        """A choice's parser events as chunks, the token event's logprobs on the first (alone if none)."""
        lp = ({"content": [chat_item(e) for e in entries or []]} if self.shape.logprobs and entries is not None
              else None)
        deltas = [tool_call_delta(self.jobs[i].id, e) for e in events]
        self.called[i] = self.called[i] or any(isinstance(e, CallStart) for e in events)
        if lp is not None and not deltas:
            deltas = [{}]
        return [self.frame([{"index": i, "delta": d, "logprobs": lp if k == 0 else None, "finish_reason": None}])
                for k, d in enumerate(deltas)]


async def _stream(store: JobStore, relay: Relay, jobs: list[Job], shape: Shape, head: dict[str, Any], n: int,
                  include_usage: bool, tool_parser: str | None = None) -> AsyncIterator[tuple[bytes, str | None]]:
    """OpenAI's stream: unnamed `data:` chunks (for chat a role chunk per choice first), each choice's
    finish chunk, the usage chunk when asked for, and `data: [DONE]`. A choice that fails or is cut
    short ends the stream with an error object instead, without `[DONE]`. With `tool_parser` (a chat that
    offered tools), each choice's text goes through it: content, and each call's index, id and name, then its
    arguments in fragments; the calls' markup is never sent as content. Yields (frame, job id ended)."""
    chunks = _Chunks(head, jobs, shape, tool_parser)
    frame, tool_frames, parsers = chunks.frame, chunks.tool_frames, chunks.parsers
    if shape.chat:
        for i in range(len(jobs)):
            yield frame([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}]), None
    offsets = [0] * len(jobs)  # completions: each choice's text so far, for text_offset
    started = [False] * len(jobs)
    ends: list[Job | None] = [None] * len(jobs)
    async for i, ev in merged_events(store, relay, jobs):
        if isinstance(ev, Cutoff):  # an error chunk, as the stream's last: its headers went out long ago
            why = ("the job store is unavailable; the generation was cut short" if ev.error is not None
                   else "the server is shutting down; the generation was cancelled" if relay.stopping
                   else "the generation's job is gone (expired, or its record damaged); it was cut short")
            yield sse.encode(orjson.dumps(error_body(503, why))), None
            return
        if not started[i] and shape.echo and not shape.chat:  # the prompt first
            started[i] = True
            echoed = await _echo_chunk(store, jobs[i].id, shape, i)
            if echoed is not None:
                offsets[i] += len(echoed["text"])
                yield frame([echoed]), None
        if isinstance(ev, TokenEvent):
            if parsers is not None:
                for chunk in tool_frames(i, parsers[i].feed(ev.text), ev.logprobs):
                    yield chunk, None
                continue
            yield frame([shape.delta(i, ev.text, ev.logprobs, offsets[i])]), None
            offsets[i] += len(ev.text)
            continue
        end = ev.job
        if end.status is JobStatus.failed:
            err = failure(end)
            yield sse.encode(orjson.dumps(error_body(err.status, err.message, err.type))), end.id
            return
        ends[i] = end
        if parsers is not None:
            for chunk in tool_frames(i, parsers[i].finish(), None):
                yield chunk, None
        yield frame([{"index": i, **({"delta": {}} if shape.chat else {"text": ""}), "logprobs": None,
                      "finish_reason": finish_reason(end, chunks.called[i] if parsers else None)}]), end.id
    if include_usage:
        yield frame([], usage=usage_of([e for e in ends if e is not None], n)), None
    yield sse.encode("[DONE]"), None


async def _echo_chunk(store: JobStore, job_id: str, shape: Shape, i: int) -> dict[str, Any] | None:
    try:
        job = await store.get(job_id)
    except DamagedRecord:  # mid-stream: its events end as an expired job's (api/streaming.py)
        return None
    if job is None:
        return None
    text = shape.head(i, job)
    lp = completion_logprobs(job.prompt[1]) if shape.logprobs and job.prompt is not None else None
    return {"index": i, "text": text, "logprobs": lp, "finish_reason": None}


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
