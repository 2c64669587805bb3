"""The scripts' typed replies (shared/scripts/codes.py) on a real Redis: every code of every script is
one the script returns, in a situation that produces it, and parses to the fields its .lua header names."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis
import redis.asyncio as aredis

from shared import names, scripts
from shared.job_ops import (
    AsyncJobOps,
    JobOps,
    queue_account,
    queue_count_after,
    queue_note_failure,
    step_write,
    stream_open,
    tail,
)
from shared.jobs import FinishReason, JobStatus, new_record
from shared.redis_client import async_client, sync_client
from shared.scripts.codes import (
    AccountCode,
    AccountReply,
    FinishCode,
    FinishReply,
    NoteFailureCode,
    StartCode,
    StepCode,
    StepReply,
    StreamOpenCode,
    SubmitCode,
    SubmitReply,
    TailReply,
)


def _url(redis_server: Any) -> str:
    return redis_server.url.rsplit("/", 1)[0] + "/13"


@pytest.fixture
def raw(redis_server) -> Iterator[redis.Redis]:  # type: ignore[no-untyped-def]
    """A client as the workers have it (not decoding), on a flushed database."""
    client = sync_client(_url(redis_server), decode=False)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@pytest.fixture
async def api_client(redis_server, raw: redis.Redis) -> AsyncIterator[aredis.Redis]:  # type: ignore[no-untyped-def]
    """A client as the API has it (decoding), on the same database."""
    client = async_client(_url(redis_server))
    yield client
    await client.aclose()


def tenant(r: redis.Redis, name: str, disabled: bool = False, **limits: int) -> str:
    r.hset(names.tenant_key(name), mapping={"disabled": "1" if disabled else "0", "rpm": 0, "tpm": 0,
                                            "max_queued": 0, **limits})
    return name


class Submitter:
    def __init__(self, client: aredis.Redis) -> None:
        self.ops, self.n = AsyncJobOps(client, 60), 0

    async def __call__(self, request: str = '{"prompt": "hi"}', **admission: Any) -> tuple[str, SubmitReply]:
        self.n += 1
        job_id = f"job_{self.n:030x}"
        return job_id, await self.ops.submit(job_id, new_record(job_id, "m", request), request, **admission)


async def test_submit_returns_every_code(raw: redis.Redis, api_client: aredis.Redis) -> None:
    submit, seen = Submitter(api_client), set()

    job_id, got = await submit()
    assert got == SubmitReply(SubmitCode.accepted, ordinal=1, dequeued=0, rpm=0, requests_left=-1, tpm=0,
                              tokens_left=-1)
    seen.add(got.code)

    acme = tenant(raw, "acme", rpm=60, tpm=1000)
    _, got = await submit(owner=acme, reserve_tokens=100)
    assert got.code is SubmitCode.accepted and got.ordinal == 2
    assert (got.rpm, got.requests_left, got.tpm, got.tokens_left) == (60, 59, 1000, 900)
    assert got.requests_reset_ms > 0 and got.tokens_reset_ms > 0

    first, got = await submit(idempotency_key="k", idempotency_ttl_s=60)
    assert got.code is SubmitCode.accepted
    _, got = await submit(idempotency_key="k", idempotency_ttl_s=60)
    assert got == SubmitReply(SubmitCode.replay, job_id=first)
    seen.add(got.code)
    _, got = await submit('{"prompt": "another body"}', idempotency_key="k", idempotency_ttl_s=60)
    assert got == SubmitReply(SubmitCode.idempotency_conflict)
    seen.add(got.code)

    for owner in ("nobody", tenant(raw, "revoked", disabled=True)):
        _, got = await submit(owner=owner)
        assert got == SubmitReply(SubmitCode.unknown_tenant)
        seen.add(got.code)

    slow = tenant(raw, "slow", rpm=1)
    assert (await submit(owner=slow))[1].code is SubmitCode.accepted
    _, got = await submit(owner=slow)
    assert got.code is SubmitCode.over_rpm and got.rpm == 1 and 0 < got.retry_ms <= 60_000
    assert 0 < got.requests_reset_ms <= 60_000
    seen.add(got.code)

    small = tenant(raw, "small", tpm=100)
    _, got = await submit(owner=small, reserve_tokens=101)
    assert got == SubmitReply(SubmitCode.request_over_tpm, tpm=100)
    seen.add(got.code)
    assert (await submit(owner=small, reserve_tokens=60))[1].code is SubmitCode.accepted
    _, got = await submit(owner=small, reserve_tokens=60)
    assert got.code is SubmitCode.over_tpm and (got.tpm, got.tokens_left) == (100, 40)
    assert got.retry_ms > 0 and got.tokens_reset_ms > 0
    seen.add(got.code)

    one = tenant(raw, "one", max_queued=1)
    assert (await submit(owner=one))[1].code is SubmitCode.accepted
    _, got = await submit(owner=one)
    assert got == SubmitReply(SubmitCode.max_queued, limit=1)
    seen.add(got.code)
    three = tenant(raw, "three", max_queued=3)  # a request of 4 jobs (n) can never fit; of 3, not beside one more
    _, got = await submit(owner=three, request_jobs=4)
    assert got == SubmitReply(SubmitCode.request_over_max_queued, limit=3)
    seen.add(got.code)
    assert (await submit(owner=three))[1].code is SubmitCode.accepted
    _, got = await submit(owner=three, request_jobs=3)
    assert got == SubmitReply(SubmitCode.max_queued, limit=3)

    waiting = int(raw.get(names.submitted_counter(0)) or 0)
    _, got = await submit(max_waiting=waiting)
    assert got == SubmitReply(SubmitCode.queue_full, depth=waiting)
    seen.add(got.code)

    assert seen == set(SubmitCode)


def _queued(r: redis.Redis, job_id: str) -> None:
    r.hset(names.job_key(job_id), mapping=new_record(job_id, "m", "{}"))


def test_start_returns_every_code(raw: redis.Redis) -> None:
    ops = JobOps(raw, 60)
    _queued(raw, "j1")
    created = float(raw.hget(names.job_key("j1"), "created_at") or 0)
    got = ops.start("j1", "w1")
    assert (got.code, got.seq, got.created_at) == (StartCode.started, 0, created)
    got = ops.start("j1", "w2")  # a redelivery
    assert got.code is StartCode.resumed and raw.hget(names.job_key("j1"), "worker") == b"w2"
    assert ops.finish("j1", FinishReason.stop) == FinishReply(FinishCode.finished, 1)
    got = ops.start("j1", "w3")
    assert (got.code, got.seq) == (StartCode.ended, 1)
    _queued(raw, "j2")
    raw.hset(names.job_key("j2"), "cancel_requested", "1")
    assert ops.start("j2", "w1").code is StartCode.cancel_requested
    assert ops.finish("j2", FinishReason.cancelled).code is FinishCode.finished
    assert ops.start("j2", "w1").code is StartCode.ended  # a cancel asked of a job that ended since: nothing to do
    got = ops.start("nope", "w1")
    assert (got.code, got.seq, got.created_at) == (StartCode.no_such_job, 0, 0.0)


async def test_finish_returns_every_code(raw: redis.Redis, api_client: aredis.Redis) -> None:
    ops, aops = JobOps(raw, 60), AsyncJobOps(api_client, 60)
    _queued(raw, "j1")
    assert ops.start("j1", "w").code is StartCode.started
    assert ops.finish("j1", FinishReason.stop, worker="w2") == FinishReply(FinishCode.not_owner)
    got = await aops.finish("j1", FinishReason.cancelled, required_status=JobStatus.queued.value)
    assert got == FinishReply(FinishCode.already_ended)  # not in the required status
    assert await aops.finish("j1", FinishReason.cancelled) == FinishReply(FinishCode.finished, 1)
    assert ops.finish("j1", FinishReason.stop) == FinishReply(FinishCode.already_ended)
    assert await aops.finish("nope", FinishReason.cancelled) == FinishReply(FinishCode.no_such_job)
    assert ops.fail("nope", "x") == FinishReply(FinishCode.no_such_job)
    pipe = raw.pipeline(transaction=True)
    _queued(raw, "j2")
    assert ops.finish("j2", FinishReason.stop, pipe=pipe) is None  # queued: its reply is the pipeline's
    assert [FinishReply.parse(r) for r in pipe.execute()] == [FinishReply(FinishCode.finished, 1)]


async def test_request_cancel_reports_the_status_before(raw: redis.Redis, api_client: aredis.Redis) -> None:
    ops, aops = JobOps(raw, 60), AsyncJobOps(api_client, 60)
    _queued(raw, "j1")
    got = await aops.request_cancel("j1")
    assert got.found and got.before == JobStatus.queued.value
    assert raw.hget(names.job_key("j1"), "cancel_requested") is None  # a queued job is ended by finish instead
    ops.start("j1", "w")
    got = await aops.request_cancel("j1")
    assert got.found and got.before == JobStatus.running.value
    assert raw.hget(names.job_key("j1"), "cancel_requested") == b"1"
    got = await aops.request_cancel("nope")
    assert not got.found and got.before == ""


async def test_stream_open_returns_every_code(raw: redis.Redis, api_client: aredis.Redis) -> None:
    assert await stream_open(api_client, "acme", "s1", 60, 1) is StreamOpenCode.opened
    assert await stream_open(api_client, "acme", "s2", 60, 1) is StreamOpenCode.at_limit
    assert await stream_open(api_client, "acme", "s2", 60, 0) is StreamOpenCode.opened  # 0: no limit
    assert raw.zcard(names.tenant_streams_key("acme")) == 2


def test_step_returns_every_code(raw: redis.Redis) -> None:
    ops, seen = JobOps(raw, 60), set()
    _queued(raw, "j1")
    ops.start("j1", "w")
    keys, args = step_write("j1", 1, 0, b"\x01\x00\x00\x00", 0, b"Hi", 1, b'{"seq":1}', 1, worker="w")
    for expected in (StepCode.written, StepCode.replayed):
        pipe = raw.pipeline(transaction=True)
        ops.step(keys, args, pipe)
        got = [StepReply.parse(r) for r in pipe.execute()]
        assert got == [StepReply((expected,))] and got[0].written + got[0].replayed == 1
        seen.add(expected)
    for job_id, worker, expected in (("j1", "w2", StepCode.not_owner), ("nope", "w", StepCode.no_such_job)):
        keys, args = step_write(job_id, 1, 0, b"", 0, b"Hi", 2, b"{}", 1, worker=worker)
        pipe = raw.pipeline(transaction=True)
        ops.step(keys, args, pipe)
        assert [StepReply.parse(r) for r in pipe.execute()] == [StepReply((expected,))]
        seen.add(expected)
    keys, args = step_write("j1", 0, 8, b"\x02\x00\x00\x00", 3, b"!", 3, b"{}", 3, worker="w")  # past the ends
    pipe = raw.pipeline(transaction=True)
    ops.step(keys, args, pipe)
    assert [StepReply.parse(r) for r in pipe.execute()] == [StepReply((StepCode.gap,))]
    assert raw.get(names.text_key("j1")) == b"Hi"
    seen.add(StepCode.gap)
    ops.finish("j1", FinishReason.stop, worker="w")
    keys, args = step_write("j1", 0, 4, b"", 2, b"!", 3, b"{}", 1, worker="w")
    pipe = raw.pipeline(transaction=True)
    ops.step(keys, args, pipe)
    assert [StepReply.parse(r) for r in pipe.execute()] == [StepReply((StepCode.ended,))]
    seen.add(StepCode.ended)
    assert seen == set(StepCode)


def test_account_and_note_failure(raw: redis.Redis) -> None:
    _queued(raw, "j1")
    raw.hset(names.job_key("j1"), mapping={"webhook_url": "http://h/x", "owner": "acme"})
    _queued(raw, "j2")
    pipe = raw.pipeline(transaction=False)
    for job_id in ("j1", "j2", "gone"):
        queue_account(pipe, job_id, 60)
    queue_note_failure(pipe, "j1", "timed out")
    queue_note_failure(pipe, "gone", "timed out")
    *accounted, noted, not_noted = scripts.execute(pipe)
    assert [AccountReply.parse(r) for r in accounted] == [
        AccountReply(AccountCode.accounted, "http://h/x", "acme"), AccountReply(AccountCode.accounted, "", ""),
        AccountReply(AccountCode.no_such_job)]
    assert AccountReply.parse(accounted[2]).expired
    assert (noted, not_noted) == (NoteFailureCode.noted, NoteFailureCode.no_such_record)
    assert raw.hget(names.job_key("j1"), "webhook_error") == b"timed out"
    assert not raw.exists(names.job_key("gone"))  # an expired record is not brought back
    assert raw.hget(names.usage_key(), "m:jobs") == b"2"


async def test_tail_and_count_after(raw: redis.Redis, api_client: aredis.Redis) -> None:
    assert await tail(api_client, names.stream(names.JOBS, 0), 5) == TailReply("0-0", [])
    ids = [raw.xadd(names.stream(names.JOBS, 0), {"job_id": f"j{i}"}).decode() for i in range(4)]
    assert await tail(api_client, names.stream(names.JOBS, 0), 3) == TailReply(ids[-1], ["j3", "j2", "j1"])
    pipe = raw.pipeline(transaction=False)
    queue_count_after(pipe, names.stream(names.JOBS, 0), ids[0], 10, 2)
    queue_count_after(pipe, names.stream(names.JOBS, 0), "0-0", 2, 1)
    assert scripts.execute(pipe) == [3, 2]


async def test_a_submit_sent_again_is_enqueued_and_charged_once(raw: redis.Redis, api_client: aredis.Redis) -> None:
    """A client that lost the reply sends the same call again (redis-py retries a dropped connection):
    the second call finds its job, so the queue holds it once and its tenant pays once."""
    ops = AsyncJobOps(api_client, 60)
    acme = tenant(raw, "acme-again", rpm=60, tpm=1000)
    job_id = names.job_id_in(names.tenant_partition(acme), "cd" * 16)
    record = new_record(job_id, "m", '{"prompt": "hi"}')
    first = await ops.submit(job_id, record, '{"prompt": "hi"}', owner=acme, reserve_tokens=100)
    again = await ops.submit(job_id, record, '{"prompt": "hi"}', owner=acme, reserve_tokens=100)
    assert first.code is SubmitCode.accepted and again == SubmitReply(SubmitCode.replay, job_id=job_id)
    stream = names.stream(names.JOBS, names.job_partition(job_id))
    assert [f[b"job_id"] for _, f in raw.xrange(stream)].count(job_id.encode()) == 1
    assert raw.get(names.tenant_active_key(acme)) == b"1"
    assert float(raw.hget(names.tenant_bucket_key(acme, "tokens"), "t")) < 1000 - 99  # 100 taken once
    assert float(raw.hget(names.tenant_bucket_key(acme, "tokens"), "t")) > 1000 - 101
