"""Admission: the submit script's refusals (SubmitCode, shared/scripts/codes.py) as errors, OpenAI's
`x-ratelimit-*` headers, and the measured throughput that caps the service-wide queue."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Annotated

import redis.asyncio as aredis
from fastapi import Depends, Request, Response

from api.auth import Caller
from api.errors import ApiError, too_many
from api.store import JobStore, partition_cap
from shared import names, scripts
from shared.jobs import Job
from shared.pool_fault import Fault
from shared.queue_depth import read_counters
from shared.schemas import GenerationRequest
from shared.scripts.codes import SubmitCode, SubmitReply
from shared.settings import Settings


def _duration(ms: int) -> str:
    """OpenAI's reset format: 250ms, 20s, 6m0s."""
    if ms < 1000:
        return f"{max(ms, 0)}ms"
    m, s = divmod(math.ceil(ms / 1000), 60)
    return f"{m}m{s}s" if m else f"{s}s"


def rate_headers(rpm: int, requests_left: int, requests_reset_ms: int, tpm: int, tokens_left: int,
                 tokens_reset_ms: int) -> dict[str, str]:
    out: dict[str, str] = {}
    if rpm > 0:
        out |= {"x-ratelimit-limit-requests": str(rpm), "x-ratelimit-remaining-requests": str(max(0, requests_left)),
                "x-ratelimit-reset-requests": _duration(requests_reset_ms)}
    if tpm > 0:
        out |= {"x-ratelimit-limit-tokens": str(tpm), "x-ratelimit-remaining-tokens": str(max(0, tokens_left)),
                "x-ratelimit-reset-tokens": _duration(tokens_reset_ms)}
    return out


async def take_request(client: aredis.Redis, caller: Caller, response: Response) -> None:
    """One request of the caller's key's requests per minute, for a call that is no job (a tokenize call, a token
    count: the tokenizer pool every tenant shares answers it), its rate-limit headers set on `response`; 429 or 401
    as a submit's would be."""
    t = caller.tenant
    if t is None:
        return
    raw = await scripts.TAKE_REQUEST.acall(client, [names.tenant_key(t.name),
                                                    names.tenant_bucket_key(t.name, "requests")], [time.time()])
    if int(raw[0]) != 1:
        raise refusal(SubmitReply.parse(raw), 0)
    rpm, left, reset_ms = (int(x) for x in raw[1:4])
    response.headers.update(rate_headers(rpm, left, reset_ms, 0, 0, 0))


def too_large(message: str) -> ApiError:
    """A request no wait can admit: a 429 (a key's limit) without Retry-After, and `x-should-retry: false`, which
    the OpenAI and Anthropic SDKs read."""
    return ApiError(429, message, type_="rate_limit_error", code="request_too_large",
                    headers={"x-should-retry": "false"})


def unavailable(model: str, fault: Fault) -> ApiError:
    """503 for a job of a model none of whose workers runs, the latest having failed to start (shared/pool_fault.py):
    it would wait for a worker that may never come. The reason stays with operators (/readyz on the internal port,
    `conveyor status`): it names files of the server."""
    return ApiError(503, f"the model '{model}' is unavailable: its inference workers are failing to start; retry "
                         "later", type_="service_unavailable", param="model", code="model_unavailable",
                    headers={"Retry-After": "30"})


def refusal(reply: SubmitReply, retry_global_ms: int) -> ApiError:
    """The submit script's refusals as errors (see SubmitCode)."""
    code = reply.code
    if code is SubmitCode.unknown_tenant:
        return ApiError(401, "invalid or revoked API key", code="invalid_api_key")
    if code is SubmitCode.over_rpm:
        return too_many(f"rate limit reached: {reply.rpm} requests per minute for this key", reply.retry_ms,
                        rate_headers(reply.rpm, 0, reply.requests_reset_ms, 0, 0, 0))
    if code is SubmitCode.over_tpm:
        return too_many(f"rate limit reached: {reply.tpm} tokens per minute for this key (prompt plus max_tokens "
                        "are reserved at submit)", reply.retry_ms,
                        rate_headers(0, 0, 0, reply.tpm, reply.tokens_left, reply.tokens_reset_ms))
    if code is SubmitCode.max_queued:
        return too_many(f"this key has {reply.limit} unfinished jobs, its limit; wait for one to end", 1000)
    if code is SubmitCode.queue_full:
        return too_many(f"the service is at capacity ({reply.depth} jobs waiting); retry later", retry_global_ms,
                        code="server_overloaded")
    if code is SubmitCode.idempotency_conflict:
        return ApiError(422, "this Idempotency-Key was used with a different request body", param="Idempotency-Key",
                        code="idempotency_key_reused")
    if code is SubmitCode.request_over_tpm:
        return too_large(f"this request reserves more tokens than the key may use in a minute ({reply.tpm}); "
                         "lower max_tokens, n or the prompts")
    if code is SubmitCode.request_over_max_queued:
        return too_large(f"this request's choices are more than the key's limit of {reply.limit} unfinished jobs; "
                         "lower n or the prompts")
    raise AssertionError(f"not a refusal: submit code {code!r}")


def queue_floor() -> int:
    """The fewest jobs the measured rate may leave waiting: 32, and 8 a partition. Each partition holds its share of
    the cap (api/store.py `partition_cap`) and a burst spreads over them unevenly: with 12 partitions and a floor of
    32, a partition's share was 3, and 16 jobs sent at once to an idle service were refused when 4 met in one."""
    return max(32, 8 * names.partition_count())


class Throughput:
    """Jobs leaving the queue per second while there is a queue (an EWMA over a few seconds), read
    from the counters the workers keep, summed over the partitions: the basis of the service-wide
    wait estimate."""

    def __init__(self, client: aredis.Redis, models: Sequence[str] = ("",), period_s: float = 2.0) -> None:
        """`models`: the served models' queues ('' the default's), whose counters it sums."""
        self.r, self.models, self.period_s = client, tuple(models), period_s
        self.rate: float | None = None
        self.depth = 0  # jobs waiting service-wide at the latest sample
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """End the sampler, as Batches.stop ends its driver: a cancellation that lands inside the Redis call can
        come out as that call's error, which the loop survives; the flag ends it then."""
        self._stopping.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def counters(self) -> tuple[int, int]:
        """Jobs submitted and jobs dequeued since the service began, over all partitions (read_counters)."""
        parts = await read_counters(self.r, self.models)
        return sum(c.submitted for c in parts), sum(c.dequeued for c in parts)

    async def _run(self) -> None:
        last: tuple[float, int] | None = None
        while not self._stopping.is_set():
            try:
                submitted, d = await self.counters()
                now = time.monotonic()
                depth = self.depth = submitted - d
                if depth <= 0:
                    self.rate = None  # no backlog, no evidence of capacity: the next burst starts afresh
                elif last is not None:
                    sample = (d - last[1]) / max(1e-3, now - last[0])
                    self.rate = sample if self.rate is None else 0.8 * self.rate + 0.2 * sample
                last = (now, d)
            except Exception:  # noqa: BLE001 - a missed sample changes nothing
                pass
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.period_s)

    def queue_cap(self, max_queued: int, max_wait_s: float) -> int:
        """Jobs that may wait: MAX_QUEUED, and no more than MAX_QUEUE_WAIT_S at the measured rate, but never fewer
        than QUEUE_FLOOR (the floor never past MAX_QUEUED). A rate of 0 (workers stopped, or not yet measured)
        leaves only MAX_QUEUED: readiness reports the rest."""
        if not self.rate:
            return max_queued
        return min(max_queued, max(queue_floor(), int(max_wait_s * self.rate)))

    def retry_ms(self, depth_over: int) -> int:
        if not self.rate:
            return 5000
        return int(min(60_000, max(1000, depth_over / self.rate * 1000)))


async def get_throughput(request: Request) -> Throughput:
    return request.app.state.throughput  # type: ignore[no-any-return]


ThroughputDep = Annotated[Throughput, Depends(get_throughput)]


def queue_full(reply: SubmitReply, cap: int, throughput: Throughput) -> tuple[SubmitReply, int]:
    """A queue_full refusal as the client sees it: the jobs waiting service-wide and how many must leave
    before a job fits. submit.lua refuses on the job's partition: its depth reached `cap` (its share of the
    service-wide cap). With one partition that is the whole queue. With several, the jobs waiting are the
    latest sample's total (at least the partition's), and the partition's excess leaves at its share of the
    service's rate (its part of the total depth, between all of it and 1/partitions): counted as that many
    times more jobs at the whole rate."""
    over = reply.depth - cap + 1
    if names.partition_count() == 1:
        return reply, over
    total = max(reply.depth, throughput.depth)
    share = max(reply.depth / total if total else 1.0, 1 / names.partition_count())
    return dataclasses.replace(reply, depth=total), math.ceil(over / share)


async def admit(store: JobStore, throughput: Throughput, settings: Settings, caller: Caller, req: GenerationRequest,
                idempotency_key: str | None = None, fields: dict[str, str] | None = None,
                request: tuple[int | None, int] = (None, 1)) -> tuple[Job, bool, dict[str, str]]:
    """Submit through admission: (job, replayed, rate-limit headers), or the refusal as an ApiError. `fields`
    go into the job's record, `request` is the share of a request of several jobs (JobStore.submit)."""
    model = req.base_model or settings.default_model
    fault = await store.fault_of(req.base_model or "")
    if fault is not None and fault.refuses(settings.bounds_of(model)[0] == 0, time.time()):
        raise unavailable(model, fault)
    cap = partition_cap(throughput.queue_cap(settings.max_queued, settings.max_queue_wait_s))
    got = await store.submit(req, idempotency_key, caller.owner, cap, fields, request=request)
    reply = got.reply
    if got.job is None:
        if reply.code is SubmitCode.replay:
            raise ApiError(409, "the job this Idempotency-Key named has just expired; send again")
        over = 0
        if reply.code is SubmitCode.queue_full:
            reply, over = queue_full(reply, cap, throughput)
        raise refusal(reply, throughput.retry_ms(over))
    headers = (rate_headers(reply.rpm, reply.requests_left, reply.requests_reset_ms, reply.tpm, reply.tokens_left,
                            reply.tokens_reset_ms) if reply.code is SubmitCode.accepted else {})
    return got.job, got.replayed, headers
