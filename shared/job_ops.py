"""The job record's operations in Redis: submit, start, step, finish, cancel, and reading it back; and
the typed calls of the protocol's other scripts.

The `*_write` functions build a script's keys and arguments, in its order (shared/scripts/*.lua name
them): every job script's here (the fair queue's in shared/fair_queue.py, a batch's in shared/batch_ops.py,
a tenant's file bytes in shared/file_ops.py); callers never touch KEYS or ARGV positions. Every key a script
touches is in its KEYS, named here from shared/names.py. `JobOps` is the synchronous
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
import uuid
from typing import Any, Literal

import redis
import redis.asyncio as aredis
import redis.asyncio.cluster as acluster
from redis.commands.core import DataAccessCommands
from redis.event import EventDispatcherInterface
from redis.exceptions import AskError, ClusterDownError, ConnectionError, TryAgainError

from shared import names, scripts, tracing
from shared.jobs import DamagedRecord, FinishReason, JobStatus, new_record
from shared.redis_client import CLUSTER_TYPES, aheal, heal, send_once, text
from shared.retry import call
from shared.schemas import GenerationRequest
from shared.scripts.codes import (
    FinishCode,
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
USAGE_TTL_S = 35 * 86400  # a day's usage totals are kept this long
OWNER_READS = 3  # how many times a finish names its job's owner before it gives up (owner_changed each time)

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


def start_write(job_id: str, worker_id: str, ttl_s: int, model: str = "") -> Write:
    """A start call (start.lua) by a worker of `model`'s queue ('' the default's), whose depth it takes the job
    from."""
    return ([names.job_key(job_id), names.dequeued_counter(names.job_partition(job_id), model)],
            [repr(time.time()), worker_id, ttl_s])


Charge = tuple[str, float, int]  # fair-queue tenant ('' none), the charge on its virtual counter, tokens served


def step_write(job_id: str, flags: int, ids_offset: int, packed_ids: bytes, text_offset: int, chunk: bytes,
               seq: int, message: bytes, n_tokens: int, logprobs_offset: int = 0, logprobs: bytes = b"",
               worker: str = "", charge: Charge = ("", 0.0, 0)) -> Write:
    """One job's part of a step call (step.lua): its 5 keys and 15 arguments. `flags`: FRESH | FIRST_TOKEN;
    `logprobs`: the chunk's tokens' logprob entries (lines of JSON) for a job that asked, at that offset;
    `worker`: the writing worker's id (the part is written only while the job's record names it); `charge`: its
    new tokens' charge to its fair-queue tenant (shared/fair_queue.py), made only if the part is written."""
    keys = [names.job_key(job_id), names.events_key(job_id), names.tokens_key(job_id), names.text_key(job_id),
            names.logprobs_key(job_id)]
    tenant, cost, tokens = charge
    return keys, [flags, ids_offset, packed_ids, text_offset, chunk, seq, message, n_tokens, names.job_channel(job_id),
                  logprobs_offset, logprobs, worker, tenant, repr(cost), tokens]


def step_call(keys: list[str], args: list[Any], ttl_s: int, publish: str = "PUBLISH", model: str = "") -> Write:
    """A whole step call: the jobs' `step_write` parts joined (jobs of one partition), after the keys and
    arguments they share (the partition's fair-queue counters of the jobs' `model`, which their charges go on).
    `publish`: PUBLISH, or SPUBLISH on a cluster (`publish_command`)."""
    p = names.stream_partition(keys[0])  # the jobs' partition, where their tenants' fair-queue counters are
    shared = [names.fair_key(p, part, model) for part in ("vtc", "tenants", "served_by")]
    return [*shared, *keys], [ttl_s, repr(time.time()), publish, *args]


def new_job(req: GenerationRequest, model: str, tool_parser: str, owner: str = "", idempotency_key: str = "",
            fields: dict[str, str] | None = None, trace: str | None = None) -> tuple[str, dict[str, Any], str]:
    """A job to submit, as every submitter (the API, the batch driver) makes one: its id (in its tenant's
    partition, else its idempotency key's, else any), its record (webhook and tool parser named; `fields`, what
    another API keeps with the job) and its request as the `jobs` stream carries it. The job's trace
    (shared/tracing.py) is `trace`, a carrier (a batch line's: its batch's), else a traced submitter's current
    span, which is given the job's id and the request's generation attributes; the carrier is kept as `trace`."""
    job_id = names.job_id_in(names.new_job_partition(owner, idempotency_key), uuid.uuid4().hex)
    request_json = req.model_dump_json(exclude_defaults=True)
    record = new_record(job_id, model, request_json, tool_parser if req.calls_tools else "")
    if req.base_model:  # a model other than the default: its queue (shared/served.py), named on its record
        record["base_model"] = req.base_model
    if trace is None and (trace := tracing.carrier()):
        tracing.annotate(job_attributes(job_id, model, req, owner))
    if trace:
        record["trace"] = trace
    if req.webhook_url:
        record["webhook_url"] = req.webhook_url  # for the after-job work (workers/after_job.py)
    record.update(fields or {})
    return job_id, record, request_json


def job_attributes(job_id: str, model: str, req: GenerationRequest, owner: str) -> dict[str, Any]:
    """A job's span attributes, OpenTelemetry's generative-AI names where they exist."""
    return {"conveyor.job.id": job_id, "conveyor.tenant": owner or None, "gen_ai.operation.name": "chat"
            if req.messages is not None else "text_completion", "gen_ai.request.model": model,
            "gen_ai.request.max_tokens": req.max_tokens, "gen_ai.request.temperature": req.temperature,
            "gen_ai.request.top_p": req.top_p, "gen_ai.request.seed": req.seed}


# a later job of a request of several, whose first job took the request's rpm and tokens (submit_write)
CHARGED = -1


def submit_write(job_id: str, record: dict[str, Any], request_json: str, ttl_s: int, owner: str = "",
                 reserve_tokens: int = 0, max_waiting: int = 0, idempotency_key: str = "", idempotency_ttl_s: int = 0,
                 jobs_maxlen: int = 1_000_000, budget: str = "interactive", request_tokens: int | None = None,
                 request_jobs: int = 1) -> Write:
    """A submit call (submit.lua). `idempotency_key` is the client's key (scoped to the owner here);
    `record` is the job hash without its request; `budget`: 'interactive' (the tenant's rpm and tpm) or
    'batch' (a batch line: its batch_tpm bucket only). A request of several jobs (OpenAI's `n`) is one request:
    its first job takes `request_tokens` (every job's reservation) and checks room for its `request_jobs`, each
    later one passes CHARGED; a job alone takes its own `reserve_tokens`."""
    p, model = names.job_partition(job_id), str(record.get("base_model") or "")  # (its queue's depth)
    idem = names.idempotency_key(owner, idempotency_key) if idempotency_key else names.job_key(job_id)
    tenant = tenant_keys(owner, names.job_key(job_id), "batch_tokens" if budget == "batch" else "tokens")
    keys = [names.job_key(job_id), names.stream(names.JOBS, p), names.submitted_counter(p, model),
            names.dequeued_counter(p, model),
            *tenant, idem, names.ring_key(p, names.TOKENIZER_GROUP)]
    args: list[Any] = [ttl_s, time.time(), owner, reserve_tokens, max_waiting,
                       idempotency_ttl_s if idempotency_key else 0, hashlib.sha256(request_json.encode()).hexdigest(),
                       jobs_maxlen, names.job_key(job_id).removesuffix(job_id), job_id, request_json, budget,
                       reserve_tokens if request_tokens is None else request_tokens, request_jobs]
    for k, v in record.items():
        if k != "request":
            args += [k, v]
    return keys, args


def tenant_keys(owner: str, stand_in: str, tokens: str = "tokens") -> list[str]:
    """A tenant's keys a job's admission and end touch: its hash, its requests and `tokens` buckets (or
    `batch_tokens`, for a batch line), its unfinished jobs; a job without a tenant touches none, and
    `stand_in` (its own key, in its slot) takes their places."""
    if not owner:
        return [stand_in] * 4
    return [names.tenant_key(owner), names.tenant_bucket_key(owner, "requests"), names.tenant_bucket_key(owner, tokens),
            names.tenant_active_key(owner)]


def finish_write(job_id: str, reason: FinishReason, error: str, ttl_s: int, required_status: str = "",
                 fields: dict[str, Any] | None = None, publish: str = "PUBLISH", worker: str = "",
                 owner: str = "", model: str = "", written: tuple[int, int] = (0, 0)) -> Write:
    """A finish call (finish.lua): the terminal status follows from `reason`. `worker`: the ending worker's
    id, which ends only a job whose record names it; '' any (the API's cancel, a failure outside a run).
    `owner` and `model`: the job's record's (`owner`, `base_model`; '' none), whose keys it names; a record
    naming others answers owner_changed. `written`: the (chunk seq, completion tokens) of the job's last
    step, which its record must show already, else the call answers behind."""
    p = names.job_partition(job_id)
    fair = [names.fair_key(p, part, model) for part in ("tenants", "payload", "queue", "age", "waiting")]
    tenant, _, _, active = tenant_keys(owner, names.job_key(job_id))
    buckets = ([names.tenant_bucket_key(owner, "tokens"), names.tenant_bucket_key(owner, "batch_tokens")] if owner
               else [names.job_key(job_id)] * 2)
    now = time.time()
    keys = [names.job_key(job_id), names.events_key(job_id), names.tokens_key(job_id), names.dequeued_counter(p, model),
            names.text_key(job_id), names.stream(names.ENDED, p), *fair, active, tenant, *buckets,
            names.ring_key(p, names.AFTER_JOB_GROUP), names.usage_key(_day(now), p), names.logprobs_key(job_id),
            names.prompt_logprobs_key(job_id)]
    args: list[Any] = [STATUS_FOR[reason].value, reason.value, error, repr(now), ttl_s,
                       names.job_channel(job_id), required_status, job_id, names.ended_min_id(now, ttl_s), owner,
                       publish, worker, model, *written, USAGE_TTL_S]
    for k, v in (fields or {}).items():
        args += [k, v]
    return keys, args


def publish_command(client: Any) -> str:
    """How a job's chunks are published through this client: sharded on a cluster (SPUBLISH in the
    job's slot reaches only the node that owns it), else PUBLISH."""
    return "SPUBLISH" if isinstance(client, CLUSTER_TYPES) else "PUBLISH"


class NotCopied(ConnectionError):
    """A cluster write that an answer would promise reached no replica within REPLICA_WAIT_MS, so a failover
    could undo it: the answer is a retryable 503 (an outage, as far as the client can tell), never the
    promise. The write itself may stand; a retry finds it (the same Idempotency-Key, the same job)."""

    def __init__(self, what: str) -> None:
        super().__init__(f"{what}: no replica confirmed the write within {REPLICA_WAIT_MS} ms; retry")


class Writes(DataAccessCommands):
    """Writes gathered for one promise (`execute_copied`): redis-py's command methods (hset, expire, zadd, ...),
    recorded rather than sent. Each command's first argument is its key."""

    # what redis-py's command methods ask of the object they are called on (their typed overloads): a client that
    # is not asyncio's (each call returns at once); and an event dispatcher, declared only (no command uses one)
    _is_async_client: Literal[False] = False
    _event_dispatcher: EventDispatcherInterface

    def __init__(self) -> None:
        self.commands: list[tuple[Any, ...]] = []

    def execute_command(self, *args: Any, **options: Any) -> Writes:
        self.commands.append(args)
        return self


async def execute_copied(client: aredis.Redis | acluster.RedisCluster, writes: Writes) -> tuple[list[Any], bool]:
    """Send `writes` and say whether a replica has them: on a cluster, each master's writes and then WAIT 1 in one
    round trip on one connection to it, never sent again (see `apromise`); (their replies, whether every master had
    a replica confirm). A failed connection raises, a slot served elsewhere is NotCopied, a refused write raises.
    A single Redis fsyncs before it answers: True."""
    if not isinstance(client, acluster.RedisCluster):
        pipe = client.pipeline(transaction=False)
        for command in writes.commands:
            pipe.execute_command(*command)
        return await pipe.execute(), True
    await client.initialize()  # the slot map (once; then a no-op)
    by_node: dict[str, list[int]] = {}
    for i, command in enumerate(writes.commands):
        node = client.get_node_from_key(command[1])
        if node is None:
            raise NotCopied(f"the write of {command[1]} (no node serves its slot)")
        by_node.setdefault(node.name, []).append(i)
    out: list[Any] = [None] * len(writes.commands)
    copied = True
    for at in by_node.values():
        *got, copies = await send_once(client, writes.commands[at[0]][1], [writes.commands[i] for i in at] + [_WAIT])
        for i, reply in zip(at, got):
            if isinstance(reply, NOT_RUN_THERE):
                await aheal(client)
                raise NotCopied(f"the write of {writes.commands[i][1]} ({reply})")
            out[i] = reply
        copied = copied and not isinstance(copies, Exception) and int(copies) >= 1
    return replies(out), copied


async def write_copied(client: aredis.Redis | acluster.RedisCluster, writes: Writes, what: str) -> list[Any]:
    """`execute_copied` for writes an answer promises (a delete, a batch's cancel): their replies, or NotCopied (a
    retryable 503) when a replica did not confirm them. Such writes are idempotent: the retry writes them again."""
    got, copied = await execute_copied(client, writes)
    if not copied:
        raise NotCopied(what)
    return got


def replies(results: list[Any]) -> list[Any]:
    """A pipeline's replies (run with raise_on_error=False), its first error raised."""
    failed = next((r for r in results if isinstance(r, Exception)), None)
    if failed is not None:
        raise failed
    return results


# a reply that says its command ran nothing on that node: its slot is served elsewhere now, or not at the moment
NOT_RUN_THERE = (AskError, TryAgainError, ClusterDownError)  # (MovedError is an AskError)
_WAIT = ("WAIT", 1, REPLICA_WAIT_MS)


def _promised_reply(reply: Any, copies: Any, what: str) -> tuple[Any, bool]:
    if isinstance(reply, NOT_RUN_THERE):
        raise NotCopied(f"{what} ({reply})")
    if isinstance(reply, Exception):
        raise reply
    return reply, not isinstance(copies, Exception) and int(copies) >= 1


async def apromise(client: acluster.RedisCluster, script: scripts.Script, write: Write,
                   what: str) -> tuple[Any, bool]:
    """A script call an answer promises, on a cluster: the call and WAIT 1 in one round trip on one connection to
    the master of its first key (its keys share a slot), never sent again; (its reply, whether a replica has its
    writes). A cluster pipeline would resend a command that failed on its own, and a WAIT sent again loses its
    node: it would answer for a connection that wrote nothing, and promise a write no replica has. A connection
    that fails raises (a retryable 503 at the door: the write may stand, and a retry with the same idempotency
    key finds it); a slot served elsewhere now is NotCopied, once the slot map is read again."""
    reply, copies = await send_once(client, write[0][0], [_eval(script, write), _WAIT])
    if isinstance(reply, NOT_RUN_THERE):
        await aheal(client)
    return _promised_reply(reply, copies, what)


def promise(client: redis.cluster.RedisCluster, script: scripts.Script, write: Write, what: str) -> tuple[Any, bool]:
    """`apromise` for a sync cluster client: a pipeline of the master's own client (a resend after a lost
    connection sends the call and its WAIT again, together, on the new one)."""
    node = client.get_node_from_key(write[0][0])
    if node is None:
        raise NotCopied(f"{what} (no node serves its slot)")
    pipe = client.get_redis_connection(node).pipeline(transaction=False)
    for command in (_eval(script, write), _WAIT):
        pipe.execute_command(*command)
    reply, copies = pipe.execute(raise_on_error=False)
    if isinstance(reply, NOT_RUN_THERE):
        heal(client)
    return _promised_reply(reply, copies, what)


def _eval(script: scripts.Script, write: Write) -> tuple[Any, ...]:
    keys, args = write
    return ("EVAL", script.source, len(keys), *keys, *args)


def request_cancel_write(job_id: str) -> Write:
    return [names.job_key(job_id)], [names.CONTROL_CHANNEL, job_id]


def _day(at: float) -> str:
    """The UTC day (YYYY-MM-DD) of a unix time: the usage key a job's end counts in."""
    return time.strftime("%Y-%m-%d", time.gmtime(at))


def account_write(job_id: str, usage_ttl_s: int) -> Write:
    """An account call (account.lua): the usage of a job that its end did not count (one ended by an earlier
    version) onto today's totals, kept `usage_ttl_s`; the job's webhook target either way."""
    return [names.job_key(job_id), names.usage_key(partition=names.job_partition(job_id))], [usage_ttl_s]


def note_failure_write(job_id: str, why: str) -> Write:
    """A note_failure call (note_failure.lua): why the job's last webhook delivery failed."""
    return note_failure_on(names.job_key(job_id), why)


def note_failure_on(record: str, why: str) -> Write:
    """A note_failure call on any record's key: a job's (`note_failure_write`) or a batch's
    (shared/batch_ops.py)."""
    return [record], [why]


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
    def __init__(self, client: redis.Redis, ttl_s: int, model: str = "") -> None:
        """`model`: the queue of the model whose jobs this process steps and ends ('' the default's)."""
        self.client, self.ttl_s, self.model = client, ttl_s, model
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
        return StartReply.parse(scripts.START(self.client, *start_write(job_id, worker_id, self.ttl_s, self.model)))

    def step(self, keys: list[str], args: list[Any], pipe: Any) -> None:
        """Queue one engine step's writes for many jobs of one partition (`step_write` parts joined) on
        `pipe`. Its reply there is a StepReply's (`StepReply.parse`), a code per
        job: a replayed step is no error, a refused job (gone, another worker's, ended) had nothing written."""
        self._queue(scripts.STEP, pipe, step_call(keys, args, self.ttl_s, self.publish, self.model))

    def finish(self, job_id: str, reason: FinishReason, error: str = "", fields: dict[str, Any] | None = None,
               pipe: Any = None, required_status: str = "", worker: str = "",
               owner: str | None = None, written: tuple[int, int] = (0, 0)) -> FinishReply | None:
        """End an active job exactly once (see finish.lua); `worker`: only if the job is that worker's, and
        `written` (its last step's chunk seq and completion tokens) already recorded. With
        `pipe`, queues it there and returns None: its reply is the pipeline's to `FinishReply.parse`.
        `owner`: the job's (StartReply.owner), whose keys the call names, its model this JobOps' own; None reads
        both from the record first (one more round trip: with `pipe`, retried through an outage, as the
        pipeline's caller retries its run), and a record that names others (owner_changed) is read again."""
        model = self.model
        for _ in range(OWNER_READS):
            if owner is None:
                owner, model = self.whose(job_id) if pipe is None else call(
                    lambda: self.whose(job_id), log=log, name=f"the owner of job {job_id}",
                    on_outage=lambda: heal(self.client))
            write = finish_write(job_id, reason, error, self.ttl_s, required_status, fields, self.publish, worker,
                                 owner, model, written)
            if pipe is not None:
                self._queue(scripts.FINISH, pipe, write)
                return None
            reply = FinishReply.parse(scripts.FINISH(self.client, *write))
            if reply.code is not FinishCode.owner_changed:
                break
            owner = None
        return reply

    def whose(self, job_id: str) -> tuple[str, str]:
        """The job's record's owner and model queue (`base_model`; '' none, or no such job)."""
        owner, model = self.client.hmget(names.job_key(job_id), "owner", "base_model")
        return text(owner), text(model)

    def fail(self, job_id: str, error: str, worker: str = "", owner: str | None = None) -> FinishReply | None:
        return self.finish(job_id, FinishReason.error, error, worker=worker, owner=owner)

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
        a 202 survives kill -9 of the master: its replica, promoted, has the job. When none confirms it in
        time, NotCopied (a 503): the job may stand on the master, and a retry with the same idempotency key
        finds it, and is answered once a replica has it."""
        write = submit_write(job_id, record, request_json, self.ttl_s, **admission)
        reply, copied = await self._promise(scripts.SUBMIT, write)
        parsed = SubmitReply.parse(reply)
        if not copied and parsed.code in (SubmitCode.accepted, SubmitCode.replay):
            raise NotCopied(f"job {parsed.job_id or job_id}")
        return parsed

    async def finish(self, job_id: str, reason: FinishReason, error: str = "", required_status: str = "",
                     owner: str | None = None) -> FinishReply:
        """End the job (the API's cancel of a queued job); NotCopied on a cluster when no replica has the end;
        DamagedRecord when its record is a key of another type. `owner` as JobOps.finish takes it."""
        model = ""
        for _ in range(OWNER_READS):
            if owner is None:
                try:
                    named, model = map(text, await self.client.hmget(names.job_key(job_id), "owner", "base_model"))
                except redis.ResponseError as exc:
                    raise (of_another_type(exc, job_id, "record") or exc) from exc
            else:
                named = owner
            write = finish_write(job_id, reason, error, self.ttl_s, required_status, publish=self.publish,
                                 owner=named, model=model)
            reply, copied = await self._promise(scripts.FINISH, write)
            parsed = FinishReply.parse(reply)
            if parsed.code is not FinishCode.owner_changed:
                break
            owner = None
        if not copied and parsed.code is FinishCode.finished:
            raise NotCopied(f"the end of job {job_id}")
        return parsed

    async def request_cancel(self, job_id: str) -> RequestCancelReply:
        """Ask the engine running the job to stop it; the reply holds its status before (see request_cancel.lua)."""
        reply, copied = await self._promise(scripts.REQUEST_CANCEL, request_cancel_write(job_id))
        parsed = RequestCancelReply.parse(reply)
        if not copied and parsed.found:
            raise NotCopied(f"the cancel of job {job_id}")
        return parsed

    async def _promise(self, script: scripts.Script, write: Write) -> tuple[Any, bool]:
        """A script call an answer promises: its reply, and whether a replica has its writes (`apromise`). A single
        Redis fsyncs before it answers."""
        if not isinstance(self.client, acluster.RedisCluster):
            return await script.acall(self.client, *write), True
        return await apromise(self.client, script, write, f"{script.name} of {write[0][0]}")

    async def read(self, job_id: str) -> dict[str, str] | None:
        """The job's record with its text so far (and its logprobs, when it asked), or None when there is no
        such job."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(names.job_key(job_id))
        pipe.get(names.text_key(job_id))
        pipe.get(names.logprobs_key(job_id))
        pipe.get(names.prompt_logprobs_key(job_id))
        replies = await pipe.execute(raise_on_error=False)
        for key, reply in zip(("record", "text", "logprobs", "prompt logprobs"), replies):
            if isinstance(reply, Exception):
                raise of_another_type(reply, job_id, key) or reply
        rec, text, logprobs, prompt_logprobs = replies
        if not rec:
            return None
        return {**rec, "text": text or "", "logprobs": logprobs or "", "prompt_logprobs": prompt_logprobs or ""}


def of_another_type(exc: BaseException, job_id: str, key: str) -> DamagedRecord | None:
    """Redis's answer that a key of the job holds another type (WRONGTYPE: written over by hand, or by another
    program), as the damaged record it makes (the API answers 404, a stream ends as for an expired job); None for
    any other error."""
    if isinstance(exc, redis.ResponseError) and str(exc).startswith("WRONGTYPE"):
        return DamagedRecord(job_id, f"its {key} is a key of another type")
    return None


def queue_account(pipe: Any, job_id: str, usage_ttl_s: int) -> None:
    """Queue an account call on `pipe` (run by `scripts.execute`); its reply there is an AccountReply's."""
    scripts.ACCOUNT.queue(pipe, *account_write(job_id, usage_ttl_s))


def queue_note_failure(pipe: Any, job_id: str, why: str) -> None:
    """Queue a note_failure call on `pipe` (run by `scripts.execute`); its reply there is a NoteFailureCode."""
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
