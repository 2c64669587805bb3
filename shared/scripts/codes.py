"""The scripts' replies, typed: per script the codes it returns (an `IntEnum` named after it) and, where its
reply has structure, a dataclass whose `parse` turns the raw reply (a list of integers and strings, bytes
from a client that does not decode) into named fields once. Each mirrors the `Returns` of its `.lua`
header; the scripts' keys and arguments are built in shared/job_ops.py, shared/fair_queue.py,
shared/batch_ops.py and shared/file_ops.py.

count_after.lua and fair_push.lua return a plain count, and fair_pop.lua a stream read (shared/fair_queue.py
parses it): none has a type here.

Every script that updates an existing record writes nothing when the record is gone (expired, or lost to a
failover before a replica had it), and says so: a `no_such_job` code (`no_such_record`, `no_such_batch`;
request_cancel.lua's empty status).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any


def _text(value: Any) -> str:
    """A reply's string (bytes from a client that does not decode); '' for nil."""
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


def _int(reply: list[Any], i: int) -> int:
    return int(reply[i]) if i < len(reply) else 0


# submit.lua


class SubmitCode(IntEnum):
    """submit.lua's first reply element: whether the job was admitted, and if not, why."""

    accepted = 1  # {1, ordinal, dequeued, rpm, requests left, requests reset ms, tpm, tokens left, tokens reset ms}
    replay = 2  # {2, job id}: an idempotent replay of the job the idempotency key names, or this call sent again
    unknown_tenant = -1  # {-1}: unknown or disabled tenant
    over_rpm = -2  # {-2, retry ms, rpm, reset ms}: over its requests per minute
    over_tpm = -3  # {-3, retry ms, tpm, left, reset ms}: over its tokens per minute
    max_queued = -4  # {-4, limit}: at its unfinished-jobs limit
    queue_full = -5  # {-5, depth}: the service-wide queue is full
    idempotency_conflict = -6  # {-6}: the idempotency key was used with another body
    request_over_tpm = -7  # {-7, tpm}: the request alone needs more than the tenant's tokens per minute
    request_over_max_queued = -8  # {-8, limit}: the request alone has more jobs than its unfinished-jobs limit


@dataclass(frozen=True)
class SubmitReply:
    """submit.lua's reply with its fields named; those its code does not carry are 0 ('' for job_id).
    requests_left / tokens_left are -1 when the tenant has no such limit (rpm / tpm 0)."""

    code: SubmitCode
    ordinal: int = 0  # accepted: the job's place in the submit order
    dequeued: int = 0  # accepted: jobs that had left the queue at submit
    rpm: int = 0  # accepted, over_rpm
    requests_left: int = 0  # accepted
    requests_reset_ms: int = 0  # accepted, over_rpm: until the requests bucket is full again
    tpm: int = 0  # accepted, over_tpm, request_over_tpm
    tokens_left: int = 0  # accepted, over_tpm
    tokens_reset_ms: int = 0  # accepted, over_tpm: until the tokens bucket is full again
    retry_ms: int = 0  # over_rpm, over_tpm: until the request would fit
    limit: int = 0  # max_queued, request_over_max_queued: the tenant's unfinished-jobs limit
    depth: int = 0  # queue_full: the jobs waiting service-wide
    job_id: str = ""  # replay: the job the idempotency key names

    @classmethod
    def parse(cls, raw: list[Any]) -> SubmitReply:
        code = SubmitCode(int(raw[0]))
        if code is SubmitCode.accepted:
            return cls(code, _int(raw, 1), _int(raw, 2), _int(raw, 3), _int(raw, 4), _int(raw, 5), _int(raw, 6),
                       _int(raw, 7), _int(raw, 8))
        if code is SubmitCode.replay:
            return cls(code, job_id=_text(raw[1]))
        if code is SubmitCode.over_rpm:
            return cls(code, retry_ms=_int(raw, 1), rpm=_int(raw, 2), requests_reset_ms=_int(raw, 3))
        if code is SubmitCode.over_tpm:
            return cls(code, retry_ms=_int(raw, 1), tpm=_int(raw, 2), tokens_left=_int(raw, 3),
                       tokens_reset_ms=_int(raw, 4))
        if code in (SubmitCode.max_queued, SubmitCode.request_over_max_queued):
            return cls(code, limit=_int(raw, 1))
        if code is SubmitCode.queue_full:
            return cls(code, depth=_int(raw, 1))
        if code is SubmitCode.request_over_tpm:
            return cls(code, tpm=_int(raw, 1))
        return cls(code)  # unknown_tenant, idempotency_conflict


# start.lua


class StartCode(IntEnum):
    """start.lua's code: whether the worker that asked is to run the job."""

    started = 1  # it was queued: it is running here now
    resumed = 2  # already running (a redelivery): resume it from seq
    ended = 0  # ended: not to be run
    cancel_requested = 3  # not ended, but its cancel was requested: not to be run, and to be ended cancelled
    no_such_job = -1


@dataclass(frozen=True)
class StartReply:
    """start.lua's {code, seq, created_at, tenant, weight, owner}: the job's last event seq, when it was
    submitted (unix s, 0 when unknown), the fair-queue tenant its generated tokens are charged to ('' none)
    with that tenant's weight, and the record's owner ('' none: the owner a finish names, JobOps.finish)."""

    code: StartCode
    seq: int
    created_at: float
    tenant: str = ""
    weight: float = 1.0
    owner: str = ""

    @classmethod
    def parse(cls, raw: list[Any]) -> StartReply:
        code, seq, created, tenant, weight, owner = raw
        return cls(StartCode(int(code)), int(seq), float(_text(created) or 0.0), _text(tenant),
                   float(_text(weight) or 1.0), _text(owner))


# finish.lua


class FinishCode(IntEnum):
    """What finish.lua's reply (a number) says: a positive one is the done event's seq."""

    finished = 1  # this call ended the job (the reply, > 0, is the done event's seq)
    already_ended = 0  # the job had already ended (or was not in the required status)
    no_such_job = -1  # nothing written
    not_owner = -2  # the ending worker is not the one the job's record names: nothing written
    owner_changed = -3  # the record names another owner than the one its keys were named for: nothing written
    behind = -4  # the record does not show the last step the finish named yet: nothing written


@dataclass(frozen=True)
class FinishReply:
    code: FinishCode
    seq: int = 0  # finished: the done event's seq

    @classmethod
    def parse(cls, raw: Any) -> FinishReply:
        n = int(raw)
        return cls(FinishCode.finished, n) if n > 0 else cls(FinishCode(n))


# request_cancel.lua


@dataclass(frozen=True)
class RequestCancelReply:
    """request_cancel.lua's reply: the job's status before the request, '' when there is no such job. Only
    a `running` job was asked to stop."""

    before: str

    @property
    def found(self) -> bool:
        return self.before != ""

    @classmethod
    def parse(cls, raw: Any) -> RequestCancelReply:
        return cls(_text(raw))


# stream_open.lua


class StreamOpenCode(IntEnum):
    """stream_open.lua's reply."""

    opened = 1  # the stream holds one of the tenant's slots now
    at_limit = 0  # the tenant holds its limit of open streams


# step.lua


class StepCode(IntEnum):
    """step.lua's code for one job of the call: whether its part was written."""

    written = 1
    replayed = 2  # already recorded (the step sent again): nothing written
    ended = 0  # not running (it ended): nothing written
    no_such_job = -1  # nothing written
    not_owner = -2  # its record names another worker (or none: queued again after a failover lost its start)
    gap = -3  # its part does not start where its text or ids end (earlier steps lost): nothing written


@dataclass(frozen=True)
class StepReply:
    """step.lua's reply: a StepCode per job, in the order of the call's jobs."""

    codes: tuple[StepCode, ...]

    @property
    def written(self) -> int:
        return self.codes.count(StepCode.written)

    @property
    def replayed(self) -> int:
        return self.codes.count(StepCode.replayed)

    @classmethod
    def parse(cls, raw: list[Any]) -> StepReply:
        return cls(tuple(StepCode(int(code)) for code in raw))


# account.lua


class AccountCode(IntEnum):
    """account.lua's first reply element."""

    accounted = 1  # {1, webhook URL, owner}: its usage is counted (by this call or an earlier one)
    no_such_job = -1  # {-1}: its record has expired; nothing written


@dataclass(frozen=True)
class AccountReply:
    """account.lua's reply: the job's webhook URL and owner ('' for none)."""

    code: AccountCode
    webhook_url: str = ""
    owner: str = ""

    @property
    def expired(self) -> bool:
        return self.code is AccountCode.no_such_job

    @classmethod
    def parse(cls, raw: list[Any]) -> AccountReply:
        code = AccountCode(int(raw[0]))
        if code is AccountCode.no_such_job:
            return cls(code)
        return cls(code, _text(raw[1]), _text(raw[2]))


# note_failure.lua


class NoteFailureCode(IntEnum):
    """note_failure.lua's reply."""

    noted = 1
    no_such_record = -1  # the job's (or batch's) record has expired: nothing written


# batch_result.lua


class BatchResultCode(IntEnum):
    """batch_result.lua's reply."""

    recorded = 1  # by this call
    already_recorded = 0
    no_such_batch = -1  # the batch's record is gone: nothing written


# tail.lua


@dataclass(frozen=True)
class TailReply:
    """tail.lua's reply: the stream's newest entry id ('0-0' when empty), then those entries' job ids,
    newest first."""

    last_id: str
    job_ids: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, raw: list[Any]) -> TailReply:
        top, *ids = raw
        return cls(_text(top), [_text(i) for i in ids])
