"""Every key a script touches is one its call declares in KEYS (as Redis asks, and as a cluster checks only for
what it is given): each call runs as a Redis user that may touch exactly the call's KEYS, so an undeclared key
fails the call (NOPERM). A job goes through its whole life so, fair queue included; and a finish whose keys
name an owner the record does not is refused, writing nothing, and JobOps.finish names them again."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis

from infra.redis_server import RedisServer
from shared import batch_ops, fair_queue, file_ops, job_ops, names, scripts, tenants
from shared.jobs import FinishReason, JobStatus, new_record
from shared.redis_client import sync_client
from shared.scripts.codes import (
    AccountCode,
    AccountReply,
    BatchResultCode,
    FinishCode,
    FinishReply,
    NoteFailureCode,
    StartCode,
    StartReply,
    StepCode,
    StepReply,
    SubmitCode,
    SubmitReply,
)

USER, PASSWORD = "declared", "declared-only"


class Declared:
    """Runs a script call as a user whose key permissions are exactly the call's KEYS."""

    def __init__(self, url: str) -> None:
        self.admin = sync_client(url, decode=False)
        self.admin.flushdb()
        self.admin.acl_setuser(USER, enabled=True, passwords=[f"+{PASSWORD}"], categories=["+@all"],
                               channels=["*"])
        at = urlsplit(url)
        self.client = redis.Redis(at.hostname or "127.0.0.1", at.port or 6379, username=USER, password=PASSWORD)

    def __call__(self, script: scripts.Script, write: job_ops.Write, allowed: list[str] | None = None) -> Any:
        """The call's reply; it may touch `allowed` keys only (its KEYS unless given)."""
        keys, args = write
        patterns = [re.sub(r"([*?\[\]\\])", r"\\\1", k) for k in dict.fromkeys(keys if allowed is None else allowed)]
        self.admin.acl_setuser(USER, enabled=True, reset_keys=True, keys=patterns)
        return script(self.client, keys, args)

    def close(self) -> None:
        self.admin.acl_deluser(USER)
        self.client.close()
        self.admin.close()


@pytest.fixture
def declared(module_redis: RedisServer) -> Iterator[Declared]:
    """Calls as a user of the module's own redis-server (its users are this module's alone)."""
    run = Declared(module_redis.url)
    yield run
    run.close()


def test_a_call_that_touches_an_undeclared_key_is_refused(declared: Declared) -> None:
    """The check itself: a script that reaches past the keys its user may touch fails, and writes nothing."""
    jobs, ended = names.stream(names.JOBS, 0), names.stream(names.ENDED, 0)
    with pytest.raises(redis.exceptions.NoPermissionError):
        declared(scripts.TAIL, job_ops.tail_write(jobs, 1), allowed=[ended])
    assert declared(scripts.TAIL, job_ops.tail_write(jobs, 1)) == [b"0-0"]


def _submit(declared: Declared, job_id: str, owner: str) -> None:
    record = {k: v for k, v in new_record(job_id, "m", "{}").items() if k != "request"}
    write = job_ops.submit_write(job_id, record, "{}", 60, owner=owner, reserve_tokens=50, idempotency_key="k",
                                 idempotency_ttl_s=60)
    assert SubmitReply.parse(declared(scripts.SUBMIT, write)).code is SubmitCode.accepted


def _push(declared: Declared, p: int, job_id: str) -> None:
    assert declared(scripts.FAIR_PUSH, fair_queue.push_write(p, [], [(job_id, 0, 10, b"row")])) == 1


def test_a_job_touches_only_the_keys_each_call_declares(declared: Declared) -> None:
    r, owner = declared.admin, "acme"
    r.hset(names.tenant_key(owner), mapping={"disabled": "0", "rpm": 60, "tpm": 1000, "max_queued": 0, "weight": 2})
    p = names.tenant_partition(owner)
    job_id = names.job_id_in(p, "ab" * 16)
    r.xgroup_create(names.stream(names.TOKENIZED, p), names.INFERENCE_GROUP, id="0", mkstream=True)
    _submit(declared, job_id, owner)
    _push(declared, p, job_id)
    assert fair_queue.waiting_jobs(r, p, owner) == [job_id]
    [entry] = fair_queue.parse_entries(declared(scripts.FAIR_POP, fair_queue.pop_write(p, "w", 4)))
    assert entry.fields[b"batch"] == b"row" and fair_queue.waiting_jobs(r, p, owner) == []
    assert r.hget(names.fair_key(p, "vtc"), owner) == b"5"  # its prompt, 10 tokens, over its weight
    took = StartReply.parse(declared(scripts.START, job_ops.start_write(job_id, "w", 60)))
    assert (took.code, took.tenant, took.owner) == (StartCode.started, owner, owner)
    step = job_ops.step_write(job_id, job_ops.FRESH | job_ops.FIRST_TOKEN, 0, job_ops.pack_ids([7]), 0, b"Hi", 1,
                              b"{}", 1, worker="w", charge=(owner, 1.0, 1))
    got = declared(scripts.STEP, job_ops.step_call(*step, 60))
    assert StepReply.parse(got).codes == (StepCode.written,)
    assert r.zscore(names.fair_key(p, "served_by"), owner) == 11
    end = job_ops.finish_write(job_id, FinishReason.stop, "", 60, worker="w", owner=owner)
    assert FinishReply.parse(declared(scripts.FINISH, end)) == FinishReply(FinishCode.finished, 2)
    assert r.get(names.tenant_active_key(owner)) == b"0"
    assert float(r.hget(names.tenant_bucket_key(owner, "tokens"), "t")) > 950 - 1  # 50 reserved, 11 used
    got = declared(scripts.ACCOUNT, job_ops.account_write(job_id, 60))
    assert AccountReply.parse(got).code is AccountCode.accounted
    assert declared(scripts.NOTE_FAILURE, job_ops.note_failure_write(job_id, "timed out")) == NoteFailureCode.noted
    assert declared(scripts.REQUEST_CANCEL, job_ops.request_cancel_write(job_id)) == JobStatus.succeeded.value.encode()
    assert declared(scripts.TAIL, job_ops.tail_write(names.stream(names.ENDED, p), 1))[1:] == [job_id.encode()]
    count = job_ops.count_after_write(names.stream(names.JOBS, p), "0-0", 10, 10)
    assert declared(scripts.COUNT_AFTER, count) == 1
    assert declared(scripts.STREAM_OPEN, job_ops.stream_open_write(owner, "s1", 60, 1)) == 1


def test_a_job_ended_while_it_waits_leaves_the_fair_queue_through_declared_keys(declared: Declared) -> None:
    r = declared.admin
    for owner in ("", "acme"):
        if owner:
            r.hset(names.tenant_key(owner), mapping={"disabled": "0", "rpm": 0, "tpm": 0, "max_queued": 0})
        p = names.new_job_partition(owner, "k")
        job_id = names.job_id_in(p, ("cd" if owner else "ef") * 16)
        _submit(declared, job_id, owner)
        _push(declared, p, job_id)
        tenant = owner or names.ANONYMOUS_TENANT
        end = job_ops.finish_write(job_id, FinishReason.cancelled, "", 60, required_status="queued", owner=owner)
        assert FinishReply.parse(declared(scripts.FINISH, end)).code is FinishCode.finished
        assert fair_queue.waiting_jobs(r, p, tenant) == [] and r.zscore(names.fair_key(p, "tenants"), tenant) is None
        assert not r.exists(*(names.fair_key(p, part) for part in ("payload", "queue", "age", "waiting")))


def test_batch_and_file_scripts_touch_only_their_keys(declared: Declared) -> None:
    r, batch = declared.admin, "batch_declared"
    r.hset(names.batch_key(batch), "status", "in_progress")
    got = declared(scripts.BATCH_RESULT, batch_ops.result_write(batch, "0", b"{}", True))
    assert got == BatchResultCode.recorded
    note = job_ops.note_failure_on(names.batch_key(batch), "refused")
    assert declared(scripts.NOTE_FAILURE, note) == NoteFailureCode.noted
    assert declared(scripts.BATCH_CANCEL, batch_ops.cancel_write(batch, 1.0)) == 1
    assert r.hget(names.batch_key(batch), "status") == b"cancelling"
    r.hset(names.batch_key(batch), "status", "completed")  # a cancel that meets the batch's end changes nothing
    assert declared(scripts.BATCH_CANCEL, batch_ops.cancel_write(batch, 2.0)) == 0
    assert r.hget(names.batch_key(batch), "status") == b"completed"
    stream = names.stream(names.JOBS, 0)
    r.xgroup_create(stream, names.TOKENIZER_GROUP, id="0", mkstream=True)
    r.xgroup_createconsumer(stream, names.TOKENIZER_GROUP, "gone")
    assert declared(scripts.PRUNE_CONSUMERS, ([stream], [names.TOKENIZER_GROUP, 0])) == 1
    tenants.create(r, "caller", rpm=1)  # a tokenize call's request, from its key's requests per minute
    took = ([names.tenant_key("caller"), names.tenant_bucket_key("caller", "requests")], [1000.0])
    assert declared(scripts.TAKE_REQUEST, took)[:3] == [1, 1, 0]
    assert declared(scripts.TAKE_REQUEST, took)[:2] == [-2, 60000]
    assert declared(scripts.FILE_BYTES, file_ops.file_bytes_write("acme", "file-1", 10, 60, 100)) == [1, 10]
    assert declared(scripts.FILE_BYTES, file_ops.file_bytes_write("acme", "file-2", 95, 60, 100)) == [0, 10]


def _state(r: redis.Redis, job_id: str, owner: str) -> tuple[Any, ...]:
    p = names.job_partition(job_id)
    return (r.hgetall(names.job_key(job_id)), r.xrange(names.events_key(job_id)),
            r.xlen(names.stream(names.ENDED, p)), r.get(names.tenant_active_key(owner)),
            r.get(names.dequeued_counter(p)), r.hgetall(names.fair_key(p, "waiting")))


def test_a_finish_whose_keys_name_another_owner_writes_nothing(declared: Declared) -> None:
    """The owner's keys are named before the call, from what the caller read of the record: a record that names
    another owner by then (a record lost and made anew, or a caller's stale read) is refused whole, and
    JobOps.finish reads the owner again and ends the job as the record has it."""
    r, owner = declared.admin, "acme"
    r.hset(names.tenant_key(owner), mapping={"disabled": "0", "rpm": 0, "tpm": 0, "max_queued": 0})
    p = names.tenant_partition(owner)
    job_id = names.job_id_in(p, "12" * 16)
    _submit(declared, job_id, owner)
    _push(declared, p, job_id)
    before = _state(r, job_id, owner)
    for named in ("", "someone-else"):
        end = job_ops.finish_write(job_id, FinishReason.cancelled, "", 60, owner=named)
        assert FinishReply.parse(declared(scripts.FINISH, end)) == FinishReply(FinishCode.owner_changed)
    assert _state(r, job_id, owner) == before and fair_queue.waiting_jobs(r, p, owner) == [job_id]
    ops = job_ops.JobOps(r, 60)
    assert ops.finish(job_id, FinishReason.cancelled, owner="someone-else") == FinishReply(FinishCode.finished, 1)
    assert r.get(names.tenant_active_key(owner)) == b"0" and fair_queue.waiting_jobs(r, p, owner) == []
    assert ops.finish(job_id, FinishReason.cancelled) == FinishReply(FinishCode.already_ended)
