"""The job record's operations in Redis: submit, start, step, finish, cancel, and reading it back.

The `*_write` functions build a script's keys and arguments, in its order (shared/scripts/*.lua name
them); callers never touch ARGV positions. `JobOps` is the synchronous face (the tokenizer pool, the
inference worker and its output lane), `AsyncJobOps` the asyncio face (the API); both send what the
same builders make.
"""

from __future__ import annotations

import hashlib
import struct
import time
from typing import Any

import redis
import redis.asyncio as aredis

from shared import names, scripts
from shared.jobs import FinishReason, JobStatus
from shared.redis_client import text

STATUS_FOR = {
    FinishReason.stop: JobStatus.succeeded,
    FinishReason.length: JobStatus.succeeded,
    FinishReason.cancelled: JobStatus.cancelled,
    FinishReason.error: JobStatus.failed,
}

# step flags (added together): the lane's first write for the job (set its keys' TTLs); its first token
FRESH = 1
FIRST_TOKEN = 2

Write = tuple[list[str], list[Any]]


def pack_ids(ids: list[int]) -> bytes:
    """Token ids as a job's token-ids key holds them: int32, little-endian, back to back."""
    return struct.pack(f"<{len(ids)}i", *ids)


def unpack_ids(data: bytes | None) -> list[int]:
    if not data:
        return []
    return list(struct.unpack(f"<{len(data) // 4}i", data[: len(data) // 4 * 4]))


def start_write(job_id: str, worker_id: str) -> Write:
    return [names.job_key(job_id), names.DEQUEUED_COUNTER], [repr(time.time()), worker_id]


def step_write(job_id: str, flags: int, ids_offset: int, packed_ids: bytes, text_offset: int, chunk: bytes,
               seq: int, message: bytes, n_tokens: int) -> Write:
    """One job's part of a step call (step.lua): its 4 keys and 9 arguments. `flags`: FRESH | FIRST_TOKEN."""
    keys = [names.job_key(job_id), names.events_key(job_id), names.tokens_key(job_id), names.text_key(job_id)]
    return keys, [flags, ids_offset, packed_ids, text_offset, chunk, seq, message, n_tokens, names.job_channel(job_id)]


def step_call(keys: list[str], args: list[Any], ttl_s: int) -> Write:
    """A whole step call: the jobs' `step_write` parts joined, after the arguments they share."""
    return keys, [ttl_s, repr(time.time()), *args]


def submit_write(job_id: str, record: dict[str, Any], request_json: str, ttl_s: int, owner: str = "",
                 reserve_tokens: int = 0, max_waiting: int = 0, idempotency_key: str = "", idempotency_ttl_s: int = 0,
                 jobs_maxlen: int = 1_000_000) -> Write:
    """A submit call (submit.lua). `idempotency_key` is the client's key (scoped to the owner here);
    `record` is the job hash without its request."""
    idem = names.idempotency_key(f"{owner}:{idempotency_key}") if idempotency_key else names.job_key(job_id)
    keys = [names.job_key(job_id), names.JOBS_STREAM, names.SUBMITTED_COUNTER, names.DEQUEUED_COUNTER,
            names.tenant_key(owner), names.tenant_bucket_key(owner, "requests"),
            names.tenant_bucket_key(owner, "tokens"), names.tenant_active_key(owner), idem]
    args: list[Any] = [ttl_s, time.time(), owner, reserve_tokens, max_waiting,
                       idempotency_ttl_s if idempotency_key else 0, hashlib.sha256(request_json.encode()).hexdigest(),
                       jobs_maxlen, names.job_key(""), job_id, request_json]
    for k, v in record.items():
        if k != "request":
            args += [k, v]
    return keys, args


def finish_write(job_id: str, reason: FinishReason, error: str, ttl_s: int, required_status: str = "",
                 fields: dict[str, Any] | None = None) -> Write:
    """A finish call (finish.lua): the terminal status follows from `reason`."""
    keys = [names.job_key(job_id), names.events_key(job_id), names.tokens_key(job_id),
            names.DEQUEUED_COUNTER, names.text_key(job_id), names.ENDED_STREAM]
    args: list[Any] = [STATUS_FOR[reason].value, reason.value, error, repr(time.time()), ttl_s,
                       names.job_channel(job_id), required_status, job_id, names.ENDED_MAXLEN, names.PREFIX]
    for k, v in (fields or {}).items():
        args += [k, v]
    return keys, args


def request_cancel_write(job_id: str) -> Write:
    return [names.job_key(job_id)], [names.CONTROL_CHANNEL, job_id]


class JobOps:
    def __init__(self, client: redis.Redis, ttl_s: int) -> None:
        self.client, self.ttl_s = client, ttl_s
        self._loaded = False

    def _queue(self, script: scripts.Script, pipe: Any, write: Write) -> Any:
        """Queue a call on a caller's pipeline. The scripts are loaded once first, so that the pipeline
        of any client finds them; after that only a Redis that lost them answers NOSCRIPT, which the
        pipelines of shared.redis_client clients replay."""
        if not self._loaded:
            try:
                scripts.load(self.client)
                self._loaded = True
            except redis.RedisError:
                pass  # unreachable now: the pipeline meets the outage and its caller retries
        return script.queue(pipe, *write)

    def start(self, job_id: str, worker_id: str) -> tuple[int, int, float]:
        """Returns (code, seq, created_at); see start.lua for the codes."""
        code, seq, created = scripts.START(self.client, *start_write(job_id, worker_id))
        return int(code), int(seq), float(created or 0.0)

    def step(self, keys: list[str], args: list[Any], pipe: Any) -> Any:
        """Queue one engine step's writes for many jobs (`step_write` parts joined) on `pipe`. Its reply
        is {chunks written, chunks skipped as replays}: a replayed step is no error."""
        return self._queue(scripts.STEP, pipe, step_call(keys, args, self.ttl_s))

    def finish(self, job_id: str, reason: FinishReason, error: str = "", fields: dict[str, Any] | None = None,
               pipe: Any = None, required_status: str = "") -> Any:
        """End an active job exactly once (see finish.lua). With `pipe`, queues it there."""
        write = finish_write(job_id, reason, error, self.ttl_s, required_status, fields)
        return self._queue(scripts.FINISH, pipe, write) if pipe is not None else scripts.FINISH(self.client, *write)

    def fail(self, job_id: str, error: str) -> Any:
        return self.finish(job_id, FinishReason.error, error)

    def resume_state(self, job_id: str) -> tuple[bytes, str, int]:
        """What a job's earlier worker recorded: (packed token ids, text, seq of the last event). The
        client must not decode responses (the ids are binary)."""
        pipe = self.client.pipeline(transaction=True)
        pipe.get(names.tokens_key(job_id))
        pipe.get(names.text_key(job_id))
        pipe.hget(names.job_key(job_id), "seq")
        ids, saved, seq = pipe.execute()
        return ids or b"", text(saved), int(seq or 0)


class AsyncJobOps:
    def __init__(self, client: aredis.Redis, ttl_s: int) -> None:
        self.client, self.ttl_s = client, ttl_s

    async def submit(self, job_id: str, record: dict[str, Any], request_json: str, **admission: Any) -> list[Any]:
        """Admit and enqueue (see submit.lua for the reply); `admission` as `submit_write` takes it."""
        return list(await scripts.SUBMIT.acall(self.client, *submit_write(job_id, record, request_json, self.ttl_s,
                                                                           **admission)))

    async def finish(self, job_id: str, reason: FinishReason, error: str = "", required_status: str = "") -> int:
        write = finish_write(job_id, reason, error, self.ttl_s, required_status)
        return int(await scripts.FINISH.acall(self.client, *write))

    async def request_cancel(self, job_id: str) -> str:
        """The job's status before the request ('' for no such job); see request_cancel.lua."""
        return text(await scripts.REQUEST_CANCEL.acall(self.client, *request_cancel_write(job_id)))

    async def read(self, job_id: str) -> dict[str, str] | None:
        """The job's record with its text so far, or None when there is no such job."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(names.job_key(job_id))
        pipe.get(names.text_key(job_id))
        rec, text = await pipe.execute()
        if not rec:
            return None
        return {**rec, "text": text or ""}
