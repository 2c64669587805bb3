"""The job record's operations in Redis: submit, start, step, finish, cancel, and reading it back; and
the typed calls of the protocol's other scripts.

The `*_write` functions build a script's keys and arguments, in its order (shared/scripts/*.lua name
them), every script's here; callers never touch KEYS or ARGV positions. `JobOps` is the synchronous
face (the tokenizer pool, the inference worker and its output lane), `AsyncJobOps` the asyncio face (the
API); both send what the same builders make. The functions after them call the scripts that are not a
job's lifecycle (the after-job work's, a tenant's stream slots, the streams' tails and lags). Replies come
back as the types of shared/scripts/codes.py, never as positions or bare integers.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import time
from typing import Any

import redis
import redis.asyncio as aredis

from shared import names, scripts
from shared.jobs import FinishReason, JobStatus
from shared.redis_client import CLUSTER_TYPES, text
from shared.scripts.codes import (
    FinishReply,
    RequestCancelReply,
    StartReply,
    StreamOpenCode,
    SubmitCode,
    SubmitReply,
    TailReply,
)

log = logging.getLogger(__name__)

STATUS_FOR = {
    FinishReason.stop: JobStatus.succeeded,
    FinishReason.length: JobStatus.succeeded,
    FinishReason.cancelled: JobStatus.cancelled,
    FinishReason.error: JobStatus.failed,
}

REPLICA_WAIT_MS = 1000  # how long a cluster write that promises something waits for a replica

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
    return [names.job_key(job_id), names.dequeued_counter(names.job_partition(job_id))], [repr(time.time()), worker_id]


def step_write(job_id: str, flags: int, ids_offset: int, packed_ids: bytes, text_offset: int, chunk: bytes,
               seq: int, message: bytes, n_tokens: int, logprobs_offset: int = 0, logprobs: bytes = b"") -> Write:
    """One job's part of a step call (step.lua): its 5 keys and 11 arguments. `flags`: FRESH | FIRST_TOKEN;
    `logprobs`: the chunk's tokens' logprob entries (lines of JSON) for a job that asked, at that offset."""
    keys = [names.job_key(job_id), names.events_key(job_id), names.tokens_key(job_id), names.text_key(job_id),
            names.logprobs_key(job_id)]
    return keys, [flags, ids_offset, packed_ids, text_offset, chunk, seq, message, n_tokens, names.job_channel(job_id),
                  logprobs_offset, logprobs]


Charges = dict[str, tuple[float, int]]  # fair-queue tenant -> (charge on its virtual counter, tokens served)


def step_call(keys: list[str], args: list[Any], ttl_s: int, publish: str = "PUBLISH",
              charges: Charges | None = None) -> Write:
    """A whole step call: the jobs' `step_write` parts joined (jobs of one partition), after the arguments
    they share. `publish`: PUBLISH, or SPUBLISH on a cluster (`publish_command`); `charges`: the step's
    new tokens per tenant (shared/fair_queue.py)."""
    prefix = keys[0][:keys[0].index(":job:")]  # the partition's, where its tenants' fair-queue counters are
    charged = [v for tenant, (cost, tokens) in (charges or {}).items() for v in (tenant, repr(cost), tokens)]
    return keys, [ttl_s, repr(time.time()), publish, prefix, len(charged) // 3, *charged, *args]


def submit_write(job_id: str, record: dict[str, Any], request_json: str, ttl_s: int, owner: str = "",
                 reserve_tokens: int = 0, max_waiting: int = 0, idempotency_key: str = "", idempotency_ttl_s: int = 0,
                 jobs_maxlen: int = 1_000_000, budget: str = "interactive") -> Write:
    """A submit call (submit.lua). `idempotency_key` is the client's key (scoped to the owner here);
    `record` is the job hash without its request; `budget`: 'interactive' (the tenant's rpm and tpm) or
    'batch' (a batch line: its batch_tpm bucket only)."""
    p = names.job_partition(job_id)
    idem = names.idempotency_key(owner, idempotency_key) if idempotency_key else names.job_key(job_id)
    # a job without a tenant touches no tenant key: its own key stands in, in its slot
    tokens = "batch_tokens" if budget == "batch" else "tokens"
    tenant = ([names.tenant_key(owner), names.tenant_bucket_key(owner, "requests"),
               names.tenant_bucket_key(owner, tokens), names.tenant_active_key(owner)] if owner
              else [names.job_key(job_id)] * 4)
    keys = [names.job_key(job_id), names.stream(names.JOBS, p), names.submitted_counter(p), names.dequeued_counter(p),
            *tenant, idem]
    args: list[Any] = [ttl_s, time.time(), owner, reserve_tokens, max_waiting,
                       idempotency_ttl_s if idempotency_key else 0, hashlib.sha256(request_json.encode()).hexdigest(),
                       jobs_maxlen, names.job_key(job_id).removesuffix(job_id), job_id, request_json, budget]
    for k, v in record.items():
        if k != "request":
            args += [k, v]
    return keys, args


def finish_write(job_id: str, reason: FinishReason, error: str, ttl_s: int, required_status: str = "",
                 fields: dict[str, Any] | None = None, publish: str = "PUBLISH") -> Write:
    """A finish call (finish.lua): the terminal status follows from `reason`."""
    keys = [names.job_key(job_id), names.events_key(job_id), names.tokens_key(job_id),
            names.dequeued_counter(names.job_partition(job_id)), names.text_key(job_id),
            names.stream(names.ENDED, names.job_partition(job_id))]
    args: list[Any] = [STATUS_FOR[reason].value, reason.value, error, repr(time.time()), ttl_s,
                       names.job_channel(job_id), required_status, job_id, names.ENDED_MAXLEN,
                       names.partition_prefix(names.job_partition(job_id)), publish]  # the job's, so its tenant's
    for k, v in (fields or {}).items():
        args += [k, v]
    return keys, args


def publish_command(client: Any) -> str:
    """How a job's chunks are published through this client: sharded on a cluster (SPUBLISH in the
    job's slot reaches only the node that owns it), else PUBLISH."""
    return "SPUBLISH" if isinstance(client, CLUSTER_TYPES) else "PUBLISH"


def queue_replica_wait(pipe: Any, node: Any) -> None:
    """Queue WAIT 1 on a cluster pipeline, to the node (so on the connection) of the writes before it:
    its reply is how many replicas have them, after at most REPLICA_WAIT_MS."""
    pipe.execute_command("WAIT", 1, REPLICA_WAIT_MS, target_nodes=node)


def request_cancel_write(job_id: str) -> Write:
    return [names.job_key(job_id)], [names.CONTROL_CHANNEL, job_id]


def account_write(job_id: str, usage_ttl_s: int) -> Write:
    """An account call (account.lua): the job's usage onto today's totals, kept `usage_ttl_s`."""
    return [names.job_key(job_id), names.usage_key(partition=names.job_partition(job_id))], [usage_ttl_s]


def note_failure_write(job_id: str, why: str) -> Write:
    """A note_failure call (note_failure.lua): why the job's last webhook delivery failed."""
    return [names.job_key(job_id)], [why]


def stream_open_write(tenant: str, stream_id: str, lease_s: int, limit: int) -> Write:
    """A stream_open call (stream_open.lua): one of the tenant's `limit` stream slots (0 none), leased `lease_s`."""
    return [names.tenant_streams_key(tenant)], [stream_id, time.time(), lease_s, limit]


def tail_write(stream: str, count: int) -> Write:
    """A tail call (tail.lua): the job ids of the stream's `count` newest entries."""
    return [stream], [count]


def count_after_write(stream: str, after_id: str, limit: int, page: int) -> Write:
    """A count_after call (count_after.lua): the stream's entries after `after_id`, counted up to `limit`,
    `page` at a time."""
    return [stream], [f"({after_id}", limit, page]


class JobOps:
    def __init__(self, client: redis.Redis, ttl_s: int) -> None:
        self.client, self.ttl_s = client, ttl_s
        self.publish = publish_command(client)
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

    def start(self, job_id: str, worker_id: str) -> StartReply:
        """Take the job (see StartCode for what the code says)."""
        return StartReply.parse(scripts.START(self.client, *start_write(job_id, worker_id)))

    def step(self, keys: list[str], args: list[Any], pipe: Any, charges: Charges | None = None) -> None:
        """Queue one engine step's writes for many jobs of one partition (`step_write` parts joined) on
        `pipe`, with their tenants' `charges`. Its reply there is a StepReply's (`StepReply.parse`): a
        replayed step is no error."""
        self._queue(scripts.STEP, pipe, step_call(keys, args, self.ttl_s, self.publish, charges))

    def finish(self, job_id: str, reason: FinishReason, error: str = "", fields: dict[str, Any] | None = None,
               pipe: Any = None, required_status: str = "") -> FinishReply | None:
        """End an active job exactly once (see finish.lua). With `pipe`, queues it there and returns None:
        its reply is the pipeline's to `FinishReply.parse`."""
        write = finish_write(job_id, reason, error, self.ttl_s, required_status, fields, self.publish)
        if pipe is not None:
            self._queue(scripts.FINISH, pipe, write)
            return None
        return FinishReply.parse(scripts.FINISH(self.client, *write))

    def fail(self, job_id: str, error: str) -> FinishReply | None:
        return self.finish(job_id, FinishReason.error, error)

    def resume_state(self, job_id: str) -> tuple[bytes, str, int, int]:
        """What a job's earlier worker recorded: (packed token ids, text, seq of the last event, bytes of
        logprob entries). The client must not decode responses (the ids are binary)."""
        pipe = self.client.pipeline(transaction=True)
        pipe.get(names.tokens_key(job_id))
        pipe.get(names.text_key(job_id))
        pipe.hget(names.job_key(job_id), "seq")
        pipe.strlen(names.logprobs_key(job_id))
        ids, saved, seq, lp_bytes = pipe.execute()
        return ids or b"", text(saved), int(seq or 0), int(lp_bytes or 0)


class AsyncJobOps:
    def __init__(self, client: aredis.Redis, ttl_s: int) -> None:
        self.client, self.ttl_s = client, ttl_s
        self.publish = publish_command(client)

    async def submit(self, job_id: str, record: dict[str, Any], request_json: str, **admission: Any) -> SubmitReply:
        """Admit and enqueue (see SubmitCode for the outcomes); `admission` as `submit_write` takes it.
        On a cluster the reply waits until a replica has the job too (WAIT 1 on the same connection), so
        a 202 survives kill -9 of the master: its replica, promoted, has the job."""
        write = submit_write(job_id, record, request_json, self.ttl_s, **admission)
        if not isinstance(self.client, CLUSTER_TYPES):
            return SubmitReply.parse(await scripts.SUBMIT.acall(self.client, *write))
        await self.client.initialize()  # type: ignore[attr-defined]  # the slot map (once; then a no-op)
        pipe = self.client.pipeline(transaction=False)
        scripts.SUBMIT.queue(pipe, *write)
        queue_replica_wait(pipe, self.client.get_node_from_key(write[0][0]))  # type: ignore[attr-defined]
        raw, copies = await pipe.execute()
        reply = SubmitReply.parse(raw)
        if reply.code is SubmitCode.accepted and int(copies) < 1:
            log.warning("job %s: no replica confirmed it within %d ms; it is on the master only", job_id,
                        REPLICA_WAIT_MS)
        return reply

    async def finish(self, job_id: str, reason: FinishReason, error: str = "",
                     required_status: str = "") -> FinishReply:
        write = finish_write(job_id, reason, error, self.ttl_s, required_status, publish=self.publish)
        return FinishReply.parse(await scripts.FINISH.acall(self.client, *write))

    async def request_cancel(self, job_id: str) -> RequestCancelReply:
        """Ask the engine running the job to stop it; the reply holds its status before (see request_cancel.lua)."""
        return RequestCancelReply.parse(await scripts.REQUEST_CANCEL.acall(self.client, *request_cancel_write(job_id)))

    async def read(self, job_id: str) -> dict[str, str] | None:
        """The job's record with its text so far (and its logprobs, when it asked), or None when there is no
        such job."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(names.job_key(job_id))
        pipe.get(names.text_key(job_id))
        pipe.get(names.logprobs_key(job_id))
        pipe.get(names.prompt_logprobs_key(job_id))
        rec, text, logprobs, prompt_logprobs = await pipe.execute()
        if not rec:
            return None
        return {**rec, "text": text or "", "logprobs": logprobs or "", "prompt_logprobs": prompt_logprobs or ""}


def queue_account(pipe: Any, job_id: str, usage_ttl_s: int) -> None:
    """Queue an account call on `pipe` (run by `scripts.execute`); its reply there is an AccountReply's."""
    scripts.ACCOUNT.queue(pipe, *account_write(job_id, usage_ttl_s))


def queue_note_failure(pipe: Any, job_id: str, why: str) -> None:
    """Queue a note_failure call on `pipe` (run by `scripts.execute`); it replies nothing."""
    scripts.NOTE_FAILURE.queue(pipe, *note_failure_write(job_id, why))


def queue_count_after(pipe: Any, stream: str, after_id: str, limit: int, page: int) -> None:
    """Queue a count_after call on `pipe` (run by `scripts.execute`); its reply there is the count (an int)."""
    scripts.COUNT_AFTER.queue(pipe, *count_after_write(stream, after_id, limit, page))


async def stream_open(client: aredis.Redis, tenant: str, stream_id: str, lease_s: int, limit: int) -> StreamOpenCode:
    """Take one of the tenant's stream slots for `stream_id` if one is free."""
    write = stream_open_write(tenant, stream_id, lease_s, limit)
    return StreamOpenCode(int(await scripts.STREAM_OPEN.acall(client, *write)))


async def tail(client: aredis.Redis, stream: str, count: int) -> TailReply:
    """The stream's newest entry id and the job ids of its `count` newest entries, newest first."""
    return TailReply.parse(await scripts.TAIL.acall(client, *tail_write(stream, count)))
