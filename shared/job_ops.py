"""Job state transitions for the (synchronous) workers, over the Lua scripts in shared.jobs."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import redis

from shared import names
from shared.jobs import FINISH_SCRIPT, START_SCRIPT, STEP_SCRIPT, FinishReason, JobStatus

STATUS_FOR = {
    FinishReason.stop: JobStatus.succeeded,
    FinishReason.length: JobStatus.succeeded,
    FinishReason.cancelled: JobStatus.cancelled,
    FinishReason.error: JobStatus.failed,
}


def step_write(job_id: str, flags: int, ids_offset: int, packed_ids: bytes, text_offset: int, chunk: bytes,
               seq: int, message: bytes, n_tokens: int) -> tuple[list[str], list[Any]]:
    """One job's part of a STEP_SCRIPT call: its 4 keys and 9 arguments, in the script's order."""
    keys = [names.job_key(job_id), names.events_key(job_id), names.tokens_key(job_id), names.text_key(job_id)]
    return keys, [flags, ids_offset, packed_ids, text_offset, chunk, seq, message, n_tokens, names.job_channel(job_id)]


def submit_write(job_id: str, record: dict[str, Any], request_json: str, ttl_s: int, owner: str = "",
                 reserve_tokens: int = 0, max_waiting: int = 0, idempotency_key: str = "", idempotency_ttl_s: int = 0,
                 jobs_maxlen: int = 1_000_000) -> tuple[list[str], list[Any]]:
    """A SUBMIT_SCRIPT call's keys and arguments, in the script's order. `idempotency_key` is the
    client's key (scoped to the owner here); `record` is the job hash without its request."""
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
                 fields: dict[str, Any] | None = None) -> tuple[list[str], list[Any]]:
    """A FINISH_SCRIPT call's keys and arguments, in the script's order (for the workers and the API)."""
    keys = [names.job_key(job_id), names.events_key(job_id), names.tokens_key(job_id),
            names.DEQUEUED_COUNTER, names.text_key(job_id), names.ENDED_STREAM]
    args: list[Any] = [STATUS_FOR[reason].value, reason.value, error, repr(time.time()), ttl_s,
                       names.job_channel(job_id), required_status, job_id, names.ENDED_MAXLEN, names.PREFIX]
    for k, v in (fields or {}).items():
        args += [k, v]
    return keys, args


class JobOps:
    def __init__(self, client: redis.Redis, ttl_s: int) -> None:
        self.client, self.ttl_s = client, ttl_s
        self._start = client.register_script(START_SCRIPT)
        self._finish = client.register_script(FINISH_SCRIPT)

    def start(self, job_id: str, worker_id: str) -> tuple[int, int, float]:
        """Returns (code, seq, created_at); see START_SCRIPT for the codes."""
        code, seq, created = self._start(keys=[names.job_key(job_id), names.DEQUEUED_COUNTER],
                                         args=[repr(time.time()), worker_id])
        return int(code), int(seq), float(created or 0.0)

    def finish(self, job_id: str, reason: FinishReason, error: str = "", fields: dict[str, Any] | None = None,
               pipe: Any = None, required_status: str = "") -> Any:
        """End an active job exactly once (see FINISH_SCRIPT). With `pipe`, queues it there."""
        keys, args = finish_write(job_id, reason, error, self.ttl_s, required_status, fields)
        return self._finish(keys=keys, args=args, client=pipe or self.client)

    def step(self, keys: list[str], args: list[Any], pipe: Any) -> Any:
        """Queue one engine step's writes for many jobs (`step_write` parts joined; see STEP_SCRIPT)
        on `pipe`. EVAL, not a registered script: a pipeline holding one checks SCRIPT EXISTS first,
        a round trip per step; Redis caches the compiled body, so EVAL costs only the text sent."""
        return pipe.eval(STEP_SCRIPT, len(keys), *keys, self.ttl_s, repr(time.time()), *args)

    def fail(self, job_id: str, error: str) -> Any:
        return self.finish(job_id, FinishReason.error, error)
