"""The API's view of jobs in Redis: submit, read, cancel, replay events."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import cast

import redis.asyncio as aredis
from redis.exceptions import RedisError, ResponseError

from api.guard import request_id
from shared import names, pool_fault, tracing
from shared.job_ops import AsyncJobOps, Writes, new_job, of_another_type, write_copied
from shared.jobs import DamagedRecord, FinishReason, Job, JobStatus
from shared.pool_fault import Fault
from shared.queue_depth import read_counters
from shared.schemas import GenerationRequest
from shared.scripts.codes import FinishCode, SubmitCode, SubmitReply
from shared.settings import Settings

log = logging.getLogger("conveyor.api")

# with several partitions, how long the other partitions' depths (for queue positions) are reused
DEPTHS_MAX_AGE_S = 1.0
DEPTHS_READ_S = 0.5  # a queue position is a best-effort figure: not worth a submit's wait on a silent master
FAULTS_MAX_AGE_S = 2.0  # how long a model's pool fault (or its absence) is reused


@dataclass
class Admission:
    """What the submit script decided: the job (None when refused, or when the job an idempotent replay
    names has just expired), whether it was an idempotent replay, and the script's reply (its code and
    rate-limit state)."""

    job: Job | None
    replayed: bool
    reply: SubmitReply


class JobStore:
    def __init__(self, client: aredis.Redis, settings: Settings) -> None:
        self.r, self.settings = client, settings  # a decoding client: replies are text
        # the last guard on the jobs stream's length, far past MAX_QUEUED (admission refuses long before):
        # XADD trims the oldest entries, normally long consumed, past it
        self.jobs_maxlen = 4 * settings.max_queued + 10_000
        self.jobs = AsyncJobOps(client, settings.job_ttl_s)
        # each partition's depth (submitted - dequeued) of a model's queue, read at its time
        self._depths: dict[str, tuple[float, list[int]]] = {}
        self._depths_lock = asyncio.Lock()
        self._faults: dict[str, tuple[float, Fault | None]] = {}  # each model's pool fault, read at its time

    async def submit(self, req: GenerationRequest, idempotency_key: str | None = None, owner: str = "",
                     max_waiting: int = 0, fields: dict[str, str] | None = None, budget: str = "interactive",
                     request: tuple[int | None, int] = (None, 1)) -> Admission:
        """Admit, store and enqueue a job in one round trip (submit.lua): an idempotent replay, the
        tenant's limits and the queue cap are checked first; a refusal stores nothing. `max_waiting` caps
        the depth of the job's partition (0: no cap): the service-wide cap's share, `partition_cap`.
        `budget` 'batch' (a batch line) charges the tenant's batch_tpm bucket instead of its rpm and tpm.
        `request`: (tokens, jobs) of the request this job is part of, as submit_write takes them."""
        model = req.model or req.base_model or self.settings.default_model  # the name asked for
        job_id, record, request_json = new_job(req, model, self.settings.tool_call_parser,
                                               owner, idempotency_key or "", fields)
        reply = await self.jobs.submit(
            job_id, record, request_json, owner=owner,
            reserve_tokens=req.reserved_tokens(), max_waiting=max_waiting,
            idempotency_key=idempotency_key or "", idempotency_ttl_s=self.settings.idempotency_ttl_s,
            jobs_maxlen=self.jobs_maxlen, budget=budget, request_tokens=request[0], request_jobs=request[1])
        if reply.code is SubmitCode.replay:  # another request's job, or this one's (a call sent again)
            return Admission(await self.get(reply.job_id), reply.job_id != job_id, reply)
        if reply.code is not SubmitCode.accepted:
            return Admission(None, False, reply)
        if record.get("trace"):  # a traced job: its request id and trace id side by side, for the logs' reader
            tracing.annotate({"conveyor.request_id": request_id.get()})
            log.info("job %s accepted: request %s, trace %s", job_id, request_id.get(), tracing.trace_id())
        job = Job.from_record({k: str(v) for k, v in record.items()})
        job.owner = owner
        job.queue_position = await self._position(job_id, str(record.get("base_model") or ""),
                                                  reply.ordinal - reply.dequeued)
        return Admission(job, False, reply)

    async def trace_of(self, job_id: str) -> str:
        """The job's trace carrier ('' when it is not traced, there is no such job, or Redis does not answer:
        a stream goes on untraced)."""
        try:
            return str(await self.r.hget(names.job_key(job_id), "trace") or "")
        except RedisError:
            return ""

    async def owner_of(self, job_id: str) -> str | None:
        """The tenant that submitted the job ('' for none), or None when there is no such job; DamagedRecord
        when its record is a key of another type."""
        pipe = self.r.pipeline(transaction=False)
        pipe.exists(names.job_key(job_id))
        pipe.hget(names.job_key(job_id), "owner")
        exists, owner = await pipe.execute(raise_on_error=False)
        if isinstance(owner, Exception):
            raise of_another_type(owner, job_id, "record") or owner
        return (owner or "") if exists else None

    async def get(self, job_id: str) -> Job | None:
        """The job, or None when there is no such job; DamagedRecord (shared/jobs.py) when its record is only
        part of one (api/errors.py answers it 404, streams end as for an expired job)."""
        rec = await self.jobs.read(job_id)
        return Job.from_record(rec, job_id) if rec is not None else None

    async def get_with(self, job_id: str, field: str) -> tuple[Job, str] | tuple[None, None]:
        """The job and one more field of its record ('' when absent), or (None, None); DamagedRecord as `get`."""
        rec = await self.jobs.read(job_id)
        return (Job.from_record(rec, job_id), rec.get(field) or "") if rec is not None else (None, None)

    async def delete(self, job_id: str) -> None:
        """Every key of an ended job (one partition: one slot); on a cluster, on a replica before the answer
        (NotCopied otherwise: a failover must not bring a deleted job back)."""
        writes = Writes()
        writes.delete(names.job_key(job_id), names.events_key(job_id), names.tokens_key(job_id),
                      names.text_key(job_id), names.logprobs_key(job_id), names.prompt_logprobs_key(job_id))
        await write_copied(self.r, writes, f"the deletion of job {job_id}")

    async def cancel(self, job_id: str, wait_s: float = 5.0) -> tuple[Job | None, bool]:
        """Returns (job, changed). changed is False when the job had already ended, or reached its own end before
        its worker heard of the cancel. A damaged record reads as no job (None) here: cancels run in cleanups (a
        stream's end), which must not raise."""
        ended = await self.jobs.finish(job_id, FinishReason.cancelled, required_status=JobStatus.queued.value)
        if ended.code is FinishCode.finished:
            return await self._get_or_none(job_id), True
        asked = await self.jobs.request_cancel(job_id)
        if not asked.found:
            return None, False
        if asked.before != JobStatus.running.value:
            return await self._get_or_none(job_id), False
        deadline = time.monotonic() + wait_s  # the engine frees the slot at its next step
        job = await self._get_or_none(job_id)
        while job is not None and not job.ended and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            job = await self._get_or_none(job_id)
        return job, job is None or not job.ended or job.status is JobStatus.cancelled

    async def _get_or_none(self, job_id: str) -> Job | None:
        try:
            return await self.get(job_id)
        except DamagedRecord:
            return None

    async def read_events(self, job_id: str, after: int, count: int = 1000) -> list[tuple[int, str, str, str]]:
        """Events with seq > after, in order: (seq, type, text, logprob entries as lines of JSON, '' none)."""
        try:
            items = cast("list[tuple[str, dict[str, str]]]",
                         await self.r.xrange(names.events_key(job_id), min=f"(0-{after}", max="+", count=count))
        except ResponseError as exc:
            raise (of_another_type(exc, job_id, "event stream") or exc) from exc
        return [(int(eid.split("-")[1]), f.get("type", ""), f.get("text", ""), f.get("logprobs", ""))
                for eid, f in items]

    async def queue_position(self, job_id: str) -> int | None:
        """Roughly how many jobs are ahead of this one, plus one: its submit ordinal minus the jobs that
        have left its partition's queue (started, failed or cancelled) since the service began; exact
        with one partition. With several, workers take the partitions in turn, so the jobs ahead in each
        other partition, up to as many as are ahead in its own, are added: an estimate (`_position`)."""
        ordinal, queue = await self.r.hmget(names.job_key(job_id), "ordinal", "base_model")
        if ordinal is None or not ordinal.isdigit():
            return None  # none, or not a number (a damaged record): no position to tell
        model = str(queue or "")  # (a decoding client: text) its model's queue, whose depth it is in
        dequeued = await self.r.get(names.dequeued_counter(names.job_partition(job_id), model))
        if not (dequeued or "0").isdigit():
            return None
        return await self._position(job_id, model, int(ordinal) - int(dequeued or 0))

    async def _position(self, job_id: str, model: str, ahead_in_partition: int) -> int:
        """A queued job's position from its place in its partition (ordinal - dequeued: exact): that, plus,
        with several partitions, min(depth, jobs ahead in its own) of every other partition's depth (as
        read within DEPTHS_MAX_AGE_S; when they cannot be read, its partition's place alone)."""
        own = max(1, ahead_in_partition)
        if names.partition_count() == 1:
            return own
        try:
            depths = await self.partition_depths(model)
        except Exception:  # noqa: BLE001 - the job is accepted already: its position is a best-effort figure
            # (Redis errors; and redis-py's cluster pipeline raises AttributeError when a node's connection is torn
            # down mid-send, as when a master is killed: that once turned an accepted job's 202 into a 500)
            return own
        mine = names.job_partition(job_id)
        return own + sum(min(d, own - 1) for p, d in enumerate(depths) if p != mine)

    async def partition_depths(self, model: str = "") -> list[int]:
        """Each partition's depth of a model's queue (submitted - dequeued: read_counters), reused for
        DEPTHS_MAX_AGE_S. One read at a time, of DEPTHS_READ_S at most; one that fails is not tried again by each
        waiter in turn (a silent master would otherwise queue every submit behind one read timeout after another):
        they take the last figures until DEPTHS_MAX_AGE_S has passed again."""
        async with self._depths_lock:
            at, depths = self._depths.get(model, (-math.inf, []))
            if time.monotonic() - at > DEPTHS_MAX_AGE_S:
                self._depths[model] = (time.monotonic(), depths)  # (a failed read below keeps the last figures)
                depths = [c.depth for c in await asyncio.wait_for(read_counters(self.r, (model,)), DEPTHS_READ_S)]
                self._depths[model] = (time.monotonic(), depths)
            return depths

    async def fault_of(self, model: str = "") -> Fault | None:
        """The start-up fault of a model's inference pool while none of its workers runs (shared/pool_fault.py),
        read at most every FAULTS_MAX_AGE_S; a read that fails or is slow counts as none (a job then queues, as it
        would without this check)."""
        at, fault = self._faults.get(model, (-math.inf, None))
        if time.monotonic() - at <= FAULTS_MAX_AGE_S:
            return fault
        self._faults[model] = (time.monotonic(), fault)  # one read at a time: the others take the last answer
        try:
            fault = await asyncio.wait_for(pool_fault.unavailable(self.r, names.inference_pool(model)),
                                           DEPTHS_READ_S)
        except Exception:  # noqa: BLE001 - a best-effort check, as partition_depths (cluster errors included)
            fault = None
        self._faults[model] = (time.monotonic(), fault)
        return fault


def partition_cap(max_waiting: int) -> int:
    """A partition's share of the service-wide cap on waiting jobs (0: no cap): submit.lua compares its
    partition's depth with it, so with one partition the cap holds exactly, with several per partition."""
    return math.ceil(max_waiting / names.partition_count())
