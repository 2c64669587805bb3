"""The API's view of jobs in Redis: submit, read, cancel, replay events."""

from __future__ import annotations

import asyncio
import time
import uuid

import redis.asyncio as aredis

from shared import names
from shared.job_ops import finish_write
from shared.jobs import FINISH_SCRIPT, REQUEST_CANCEL_SCRIPT, SUBMIT_SCRIPT, FinishReason, Job, JobStatus, new_record
from shared.schemas import GenerationRequest
from shared.settings import Settings


class JobStore:
    def __init__(self, client: aredis.Redis, settings: Settings) -> None:
        self.r, self.settings = client, settings
        self._finish = client.register_script(FINISH_SCRIPT)
        self._request_cancel = client.register_script(REQUEST_CANCEL_SCRIPT)
        self._submit = client.register_script(SUBMIT_SCRIPT)

    async def submit(self, req: GenerationRequest, idempotency_key: str | None = None,
                     background: bool = True) -> tuple[Job, bool]:
        """Store and enqueue a job. Returns (job, replayed): replayed when the key was seen before."""
        job_id = "job_" + uuid.uuid4().hex
        if idempotency_key:
            key = names.idempotency_key(idempotency_key)
            if not await self.r.set(key, job_id, nx=True, ex=self.settings.idempotency_ttl_s):
                existing = await self.r.get(key)
                job = await self.get(existing) if existing else None
                if job is not None:
                    return job, True
                await self.r.set(key, job_id, ex=self.settings.idempotency_ttl_s)
        request_json = req.model_dump_json(exclude_defaults=True)
        record = new_record(job_id, self.settings.served_model_name, request_json, background)
        if req.webhook_url:
            record["webhook_url"] = req.webhook_url  # for the after-job work (workers/after_job.py)
        args: list[str | int] = [self.settings.job_ttl_s]
        for k, v in record.items():
            if k != "request":
                args += [k, v]
        args += [job_id, request_json]
        ordinal, dequeued = await self._submit(
            keys=[names.job_key(job_id), names.JOBS_STREAM, names.SUBMITTED_COUNTER, names.DEQUEUED_COUNTER],
            args=args)
        job = Job.from_record({k: str(v) for k, v in record.items()})
        job.queue_position = max(1, int(ordinal) - int(dequeued))
        return job, False

    async def get(self, job_id: str) -> Job | None:
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(names.job_key(job_id))
        pipe.get(names.text_key(job_id))
        rec, text = await pipe.execute()
        if not rec:
            return None
        rec["text"] = text or ""
        return Job.from_record(rec)

    async def cancel(self, job_id: str, wait_s: float = 5.0) -> tuple[Job | None, bool]:
        """Returns (job, changed). changed is False when the job had already ended."""
        keys, args = finish_write(job_id, FinishReason.cancelled, "", self.settings.job_ttl_s,
                                  required_status=JobStatus.queued.value)
        ended = await self._finish(keys=keys, args=args)
        if int(ended) > 0:
            return await self.get(job_id), True
        before = await self._request_cancel(keys=[names.job_key(job_id)], args=[names.CONTROL_CHANNEL, job_id])
        if not before:
            return None, False
        if before != JobStatus.running.value:
            return await self.get(job_id), False
        deadline = time.monotonic() + wait_s  # the engine frees the slot at its next step
        job = await self.get(job_id)
        while job is not None and not job.ended and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            job = await self.get(job_id)
        return job, True

    async def read_events(self, job_id: str, after: int, count: int = 1000) -> list[tuple[int, str, str]]:
        """Events with seq > after, in order: (seq, type, text)."""
        items = await self.r.xrange(names.events_key(job_id), min=f"(0-{after}", max="+", count=count)
        return [(int(eid.split("-")[1]), f.get("type", ""), f.get("text", "")) for eid, f in items]

    async def queue_position(self, job_id: str) -> int | None:
        """Roughly how many jobs are ahead of this one, plus one: its submit ordinal minus the
        jobs that have left the queue (started, failed or cancelled) since the service began."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hget(names.job_key(job_id), "ordinal")
        pipe.get(names.DEQUEUED_COUNTER)
        ordinal, dequeued = await pipe.execute()
        if ordinal is None:
            return None
        return max(1, int(ordinal) - int(dequeued or 0))
