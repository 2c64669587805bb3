"""The Redis protocol's scripts: one documented file each, called by SHA with a NOSCRIPT fallback
(pipelines included, never SCRIPT EXISTS), a step that tolerates being replayed, nothing written into a
record that is gone, and a job written only by the worker that runs it."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.exceptions import OutOfMemoryError

from infra.redis_cluster import cluster_binary
from infra.redis_server import RedisServer
from shared import fair_queue, names, scripts
from shared.job_ops import (
    FIRST_TOKEN,
    FRESH,
    JobOps,
    pack_ids,
    queue_account,
    queue_note_failure,
    request_cancel_write,
    step_write,
)
from shared.jobs import FinishReason, new_record
from shared.redis_client import RETRYABLE, async_client, sync_client
from shared.redis_errors import WritesRefusedError
from shared.scripts.codes import (
    AccountCode,
    AccountReply,
    BatchResultCode,
    FinishCode,
    FinishReply,
    NoteFailureCode,
    RequestCancelReply,
    StartCode,
    StepCode,
    StepReply,
)
from tests.helpers import writes_refused


@pytest.fixture
def raw(redis_server) -> Iterator[redis.Redis]:  # type: ignore[no-untyped-def]
    """A client of ours (its pipelines replay NOSCRIPT), on a flushed database, not decoding (as the workers)."""
    client = sync_client(redis_server.url.rsplit("/", 1)[0] + "/13", decode=False)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


def test_every_script_is_a_documented_file() -> None:
    files = {p.stem for p in scripts.HERE.glob("*.lua")}
    assert files == {s.name for s in scripts.ALL}
    for script in scripts.ALL:
        header = "\n".join(line for line in script.source.splitlines() if line.startswith("--"))
        assert re.search(r"^-- KEYS", header, re.M), script.name
        assert re.search(r"^-- ARGV", header, re.M) or "ARGV" not in script.source.replace(header, ""), script.name
        assert "Returns" in header, script.name


def test_scripts_ship_with_the_package() -> None:
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert '"shared.scripts" = ["*.lua"]' in pyproject


def test_a_call_loads_the_script_when_redis_lost_it(raw: redis.Redis) -> None:
    raw.script_flush()
    assert scripts.TAIL(raw, [names.stream(names.JOBS, 0)], [5]) == [b"0-0"]


@pytest.mark.parametrize("how, refusal", [("full", OutOfMemoryError), ("no replicas", WritesRefusedError),
                                           ("failed save", WritesRefusedError)], ids=["OOM", "NOREPLICAS", "MISCONF"])
def test_a_redis_refusing_writes_refuses_a_script_as_it_refuses_a_command(tmp_path: Path, how: str,
                                                                          refusal: type[Exception]) -> None:
    """Redis refuses every write when it is full (at its maxmemory, noeviction: OOM), short of replicas
    (NOREPLICAS) or after a failed save (a failed disk: MISCONF), a script at its first write with an error reply
    that only names it in its text: each reaches callers as the command's class, called, pipelined or through the
    asyncio client, which every loop waits out as an outage (shared.redis_client.RETRYABLE) and the API answers 503;
    nothing of it was written, and the same call succeeds once Redis takes writes again."""
    server = RedisServer(tmp_path / "redis", appendonly=False, maxmemory_mb=16)
    server.start()
    try:
        raw = sync_client(server.url, decode=False)
        raw.hset(names.job_key("job_full"), mapping=new_record("job_full", "m", ""))  # queued, to be pushed
        job = [("job_full", 0, 1, b"request")]
        with writes_refused(raw, how, tmp_path / "disk"):
            before = set(raw.keys())
            with pytest.raises(refusal) as refused:
                fair_queue.push(raw, 0, ["1-0"], job)
            assert isinstance(refused.value, RETRYABLE)
            with pytest.raises(refusal):
                raw.xadd(names.stream(names.JOBS, 0), {"job_id": "job_full"})
            pipe = raw.pipeline(transaction=False)
            scripts.FAIR_PUSH.queue(pipe, *fair_queue.push_write(0, ["1-0"], job))
            [reply] = pipe.execute(raise_on_error=False)
            assert isinstance(reply, refusal)
            with pytest.raises(refusal):
                asyncio.run(_push_async(server.url, job))
            assert set(raw.keys()) == before  # nothing written
            assert raw.hget(names.job_key("job_full"), "fair_queued") is None
        assert fair_queue.push(raw, 0, ["1-0"], job) == 1
        raw.close()
    finally:
        server.stop()


class Redis7(RedisServer):
    """A lone redis-server 7 (the cluster's binary; the embedded one is 6.2)."""

    def command(self) -> list[str]:
        return [cluster_binary(), str(self.config_path)]


def test_a_refused_step_keeps_its_class_on_redis_7(tmp_path: Path) -> None:
    """Redis 7 (a cluster's nodes) answers a write refused inside a script with the refusal's own code, which
    redis-py raises as its class: a cluster's pipeline (the output lane's on a cluster) has nothing else to tell an
    outage from a failure by. step.lua runs each job's part under pcall (a damaged key fails its job alone), and
    must answer a refusal with its code still (re-raised as a Lua error, it came back as a plain ERR, and every
    running job failed as incomplete once the refusal ended)."""
    try:
        cluster_binary()
    except SystemExit as e:
        pytest.skip(str(e))
    server = Redis7(tmp_path / "redis", appendonly=False)
    server.start()
    try:
        plain = redis.Redis.from_url(server.url)
        raw = sync_client(server.url, decode=False)
        _running_job(raw, "job_r7")
        keys, args = step_write("job_r7", FRESH | FIRST_TOKEN, 0, pack_ids([7]), 0, b"Hi", 1, b"{}", 1, worker="w")
        scripts.load(plain)

        def step() -> Any:
            pipe = plain.pipeline(transaction=False)  # redis-py's own, as a cluster's: nothing maps its replies
            JobOps(raw, 60).step(keys, args, pipe)
            return pipe.execute(raise_on_error=False)[0]

        with writes_refused(raw, "no replicas"):
            assert isinstance(step(), WritesRefusedError)
        assert StepReply.parse(step()) == StepReply((StepCode.written,))
        plain.close()
        raw.close()
    finally:
        server.stop()


async def _push_async(url: str, job: list[Any]) -> None:
    client = async_client(url)
    try:
        await scripts.FAIR_PUSH.acall(client, *fair_queue.push_write(0, ["1-0"], job))
    finally:
        await client.aclose()


def _commands(client: redis.Redis) -> dict[str, int]:
    return {k: int(v["calls"]) for k, v in client.info("commandstats").items()}


def test_a_pipeline_replays_what_answered_noscript_in_order(module_redis: RedisServer) -> None:
    """(On the module's own redis-server: its command counts are this test's alone.)"""
    raw = sync_client(module_redis.url, decode=False)
    plain = redis.Redis.from_url(module_redis.url)
    for transaction in (True, False):
        raw.flushdb()
        raw.script_flush()
        raw.config_resetstat()
        pipe = plain.pipeline(transaction=transaction)  # any client's pipeline, through scripts.execute
        pipe.set("before", 1)
        scripts.TAIL.queue(pipe, [names.stream(names.JOBS, 0)], [5])
        pipe.incr("before")
        assert scripts.execute(pipe) == [True, [b"0-0"], 2]
        stats = _commands(raw)
        assert stats["cmdstat_evalsha"] == 2 and stats.get("cmdstat_eval", 0) == 0
        assert stats["cmdstat_script"] == len(scripts.ALL)  # the loads, and no SCRIPT EXISTS
    plain.close()
    raw.close()


def test_our_clients_pipelines_replay_noscript_on_their_own(raw: redis.Redis) -> None:
    raw.script_flush()
    pipe = raw.pipeline(transaction=True)
    scripts.TAIL.queue(pipe, [names.stream(names.ENDED, 0)], [1])
    assert pipe.execute() == [[b"0-0"]]


def _running_job(r: redis.Redis, job_id: str) -> None:
    r.hset(names.job_key(job_id), mapping=new_record(job_id, "m", "{}"))
    assert JobOps(r, 60).start(job_id, "w").code is StartCode.started


def test_a_replayed_step_is_reported_not_raised(raw: redis.Redis) -> None:
    ops = JobOps(raw, 60)
    _running_job(raw, "j1")
    keys, args = step_write("j1", FRESH | FIRST_TOKEN, 0, b"\x01\x00\x00\x00", 0, b"Hi", 1, b'{"seq":1}', 1,
                            worker="w")
    pipe = raw.pipeline(transaction=True)
    ops.step(keys, args, pipe)
    ops.step(keys, args, pipe)  # the same step again, as after a reconnect
    assert pipe.execute() == [[StepCode.written], [StepCode.replayed]]
    # the step and the finish sent again after both went through: the job has ended, by this worker
    for expected in ([[StepCode.replayed], 2], [[StepCode.ended], FinishCode.already_ended]):
        raw.script_flush()
        pipe = raw.pipeline(transaction=True)
        ops.step(keys, args, pipe)
        ops.finish("j1", FinishReason.stop, fields={"completion_tokens": 1}, pipe=pipe, worker="w")
        assert pipe.execute(raise_on_error=False) == expected
    assert [e for e, _ in raw.xrange(names.events_key("j1"))] == [b"0-1", b"0-2"]
    assert raw.hget(names.job_key("j1"), "seq") == b"2"  # the replay did not wind it back
    assert raw.get(names.text_key("j1")) == b"Hi"
    assert ops.resume_state("j1") == (b"\x01\x00\x00\x00", "Hi", 2, 0)
    assert 0 < raw.ttl(names.tokens_key("j1")) <= 60


def test_a_step_charges_a_tenant_only_for_its_jobs_written(raw: redis.Redis) -> None:
    """A step call sent again (its pipeline met an outage after part of it ran) charges each job's tenant once: a
    job written, not one refused or replayed, even when another job of the call is written this time."""
    ops = JobOps(raw, 60)
    _running_job(raw, "ja")
    _running_job(raw, "jb")
    raw.hset(names.job_key("jb"), "worker", "other")  # jb's part is refused the first time
    keys: list[str] = []
    args: list[Any] = []
    for job_id in ("ja", "jb"):
        k, a = step_write(job_id, FRESH | FIRST_TOKEN, 0, pack_ids([7, 8]), 0, b"Hi", 1, b"{}", 2, worker="w",
                          charge=("acme", 1.5, 2))
        keys += k
        args += a
    vtc, served = (names.fair_key(names.job_partition("ja"), part) for part in ("vtc", "served_by"))

    def step() -> list[StepCode]:
        pipe = raw.pipeline(transaction=False)
        ops.step(keys, args, pipe)
        [reply] = pipe.execute()
        return list(StepReply.parse(reply).codes)

    assert step() == [StepCode.written, StepCode.not_owner]
    assert (raw.hget(vtc, "acme"), raw.zscore(served, "acme"), raw.zscore(served, names.SERVED_TOTAL)) == (b"1.5", 2, 2)
    raw.hset(names.job_key("jb"), "worker", "w")
    assert step() == [StepCode.replayed, StepCode.written]
    assert (raw.hget(vtc, "acme"), raw.zscore(served, "acme"), raw.zscore(served, names.SERVED_TOTAL)) == (b"3", 4, 4)
    assert step() == [StepCode.replayed, StepCode.replayed]
    assert (raw.hget(vtc, "acme"), raw.zscore(served, "acme"), raw.zscore(served, names.SERVED_TOTAL)) == (b"3", 4, 4)


def test_step_flags_fresh_and_first_token(raw: redis.Redis) -> None:
    ops = JobOps(raw, 60)
    _running_job(raw, "j2")
    pipe = raw.pipeline(transaction=True)
    keys, args = step_write("j2", FRESH, 0, b"", 0, b"", 0, b"", 0, worker="w")
    ops.step(keys, args, pipe)
    pipe.execute()
    assert raw.hget(names.job_key("j2"), "first_token_at") is None
    keys, args = step_write("j2", FIRST_TOKEN, 0, b"\x02\x00\x00\x00", 0, b"", 0, b"", 1, worker="w")
    ops.step(keys, args, pipe)
    ops.step(keys, args, pipe)  # ids without a chunk, sent again: not past the recorded completion_tokens
    assert pipe.execute() == [[StepCode.written], [StepCode.replayed]]
    assert raw.hget(names.job_key("j2"), "first_token_at") is not None
    assert raw.hget(names.job_key("j2"), "completion_tokens") == b"1"


def test_a_job_taken_and_written_counts_its_ttl_afresh(raw: redis.Redis) -> None:
    """JOB_TTL_S counts from a job's last step forward, not from its submit: a job that waited for most of its
    TTL (in `jobs`, then in the fair queue) is not lost before it runs or while it does."""
    key = names.job_key("j3")
    raw.hset(key, mapping=new_record("j3", "m", "{}"))
    raw.expire(key, 2)  # the submit's TTL, nearly spent
    assert fair_queue.push(raw, 0, [], [("j3", 0, 10, b"row")], ttl_s=600) == 1
    assert raw.ttl(key) > 500
    raw.expire(key, 2)
    ops = JobOps(raw, 600)
    assert ops.start("j3", "w").code is StartCode.started
    assert raw.ttl(key) > 500
    raw.expire(key, 2)
    keys, args = step_write("j3", FRESH | FIRST_TOKEN, 0, pack_ids([7]), 0, b"Hi", 1, b"{}", 1, worker="w")
    pipe = raw.pipeline(transaction=True)
    ops.step(keys, args, pipe)
    assert pipe.execute() == [[StepCode.written]]
    assert raw.ttl(key) > 500 and raw.ttl(names.events_key("j3")) > 500
    for k in (key, names.events_key("j3"), names.text_key("j3")):
        raw.expire(k, 200)  # a running job whose TTL is more than half gone: its next write sets it afresh
    keys, args = step_write("j3", 0, 4, pack_ids([8]), 2, b"!", 2, b"{}", 2, worker="w")
    ops.step(keys, args, pipe)
    assert pipe.execute() == [[StepCode.written]]
    assert all(raw.ttl(k) > 500 for k in (key, names.events_key("j3"), names.text_key("j3")))
    raw.expire(key, 2)
    assert ops.start("j3", "w2").code is StartCode.resumed  # a redelivery takes it over: afresh again
    assert raw.ttl(key) > 500


def test_a_jobs_end_keeps_its_logprobs_as_long_as_its_record(raw: redis.Redis) -> None:
    """Its logprob entries and prompt logprobs count the retention afresh with its end, as its record, text and
    events do. Before, they kept the TTL of their first write: a job that ran a while was polled `succeeded` with its
    text and no logprobs, for up to that while before its record went."""
    ops = JobOps(raw, 600)
    _running_job(raw, "j4")
    keys, args = step_write("j4", FRESH | FIRST_TOKEN, 0, pack_ids([7]), 0, b"Hi", 1, b"{}", 1, 0, b'{"lp":1}\n',
                            worker="w")
    pipe = raw.pipeline(transaction=True)
    ops.step(keys, args, pipe)
    assert pipe.execute() == [[StepCode.written]]
    raw.set(names.prompt_logprobs_key("j4"), b"[]", ex=600)
    for key in (names.logprobs_key("j4"), names.prompt_logprobs_key("j4")):
        raw.expire(key, 100)  # written long before the end
    assert ops.finish("j4", FinishReason.stop, fields={"completion_tokens": 1}, worker="w")
    assert all(raw.ttl(k) > 500 for k in job_keys("j4")), {k: raw.ttl(k) for k in job_keys("j4")}


MARKER = b"marker: nothing was published before this"


def published(r: redis.Redis, channels: list[str], act: Callable[[], object]) -> list[bytes]:
    """What `act` published on `channels`: a marker published after it is the last message to wait for (one
    connection's messages arrive in their order), so nothing waits on a fixed sleep."""
    sub = r.pubsub()
    sub.subscribe(*channels)
    for _ in channels:
        assert (sub.get_message(timeout=5) or {}).get("type") == "subscribe"
    act()
    r.publish(channels[-1], MARKER)
    got = []
    while (msg := sub.get_message(timeout=5)) is not None and msg["data"] != MARKER:
        got.append(msg["data"])
    sub.close()
    assert msg is not None, "the marker never came"
    return got


def job_keys(job_id: str) -> list[str]:
    return [names.job_key(job_id), names.events_key(job_id), names.tokens_key(job_id), names.text_key(job_id),
            names.logprobs_key(job_id), names.prompt_logprobs_key(job_id)]


def _step(ops: JobOps, job_id: str, worker: str, seq: int, text: str, chunk: str,
          charge: tuple[str, float, int] = ("", 0.0, 0)) -> list[StepCode]:
    """One step call of one job: its `seq`th token (an id 7) with its chunk, after `text`."""
    flags = FRESH | FIRST_TOKEN if seq == 1 else 0
    keys, args = step_write(job_id, flags, (seq - 1) * 4, pack_ids([7]), len(text.encode()), chunk.encode(), seq,
                            b'{"seq": %d}' % seq, seq, 0, b"", worker, charge)
    pipe = ops.client.pipeline(transaction=True)
    ops.step(keys, args, pipe)
    [raw] = pipe.execute()
    return list(StepReply.parse(raw).codes)


def test_no_script_writes_into_a_record_that_is_gone(raw: redis.Redis) -> None:
    """A record lost (to a failover, before a replica had it) is not brought back as a half record by the
    scripts that update a job: each says so and writes nothing, publishes nothing."""
    ops, job_id = JobOps(raw, 60), "job_gone_0001"
    p = names.job_partition(job_id)

    def every_script() -> None:
        assert ops.start(job_id, "w").code is StartCode.no_such_job
        assert _step(ops, job_id, "w", 1, "", "Hi") == [StepCode.no_such_job]
        assert _step(ops, job_id, "", 1, "", "Hi") == [StepCode.no_such_job]
        for worker in ("w", ""):
            got = ops.finish(job_id, FinishReason.stop, fields={"completion_tokens": 1}, worker=worker)
            assert got == FinishReply(FinishCode.no_such_job)
        got = ops.finish(job_id, FinishReason.cancelled, required_status="queued")  # the API's cancel
        assert got == FinishReply(FinishCode.no_such_job)
        got = RequestCancelReply.parse(scripts.REQUEST_CANCEL(raw, *request_cancel_write(job_id)))
        assert not got.found
        pipe = raw.pipeline(transaction=False)
        queue_account(pipe, job_id, 60)
        queue_note_failure(pipe, job_id, "timed out")
        accounted, noted = scripts.execute(pipe)
        assert AccountReply.parse(accounted) == AccountReply(AccountCode.no_such_job)
        assert noted == NoteFailureCode.no_such_record

    assert published(raw, [names.job_channel(job_id), names.CONTROL_CHANNEL], every_script) == []
    assert raw.exists(*job_keys(job_id)) == 0
    assert raw.exists(names.dequeued_counter(p), names.stream(names.ENDED, p), names.usage_key(partition=p)) == 0


def test_a_batch_result_for_a_batch_that_is_gone_writes_nothing(raw: redis.Redis) -> None:
    batch = "batch_gone_0001"
    keys = [names.batch_key(batch), names.batch_key(batch, "out"), names.batch_key(batch, "inflight")]
    raw.hset(keys[2], "0", "job_x")  # its own TTL outlived the record's
    assert scripts.BATCH_RESULT(raw, keys, ["0", b"{}", "completed"]) == BatchResultCode.no_such_batch
    assert raw.exists(keys[0], keys[1]) == 0 and raw.hget(keys[2], "0") == b"job_x"
    raw.hset(keys[0], "status", "in_progress")
    assert scripts.BATCH_RESULT(raw, keys, ["0", b"{}", "completed"]) == BatchResultCode.recorded
    assert scripts.BATCH_RESULT(raw, keys, ["0", b"{}", "completed"]) == BatchResultCode.already_recorded
    assert raw.hget(keys[0], "completed") == b"1" and not raw.exists(keys[2])
    assert raw.ttl(keys[1]) == -1  # a record without a TTL: none for its results either
    raw.expire(keys[0], 600)
    assert scripts.BATCH_RESULT(raw, keys, ["1", b"{}", "completed"]) == BatchResultCode.recorded
    assert 0 < raw.ttl(keys[1]) <= 600  # its results go with the record, lost or expired


def _state(r: redis.Redis, job_id: str) -> tuple[Any, ...]:
    """Everything a step writes of a job: its record, text, ids, logprobs and events."""
    return (r.hgetall(names.job_key(job_id)), r.get(names.text_key(job_id)), r.get(names.tokens_key(job_id)),
            r.get(names.logprobs_key(job_id)), r.xrange(names.events_key(job_id)))


def test_a_worker_that_lost_its_job_writes_nothing_into_it(raw: redis.Redis) -> None:
    """A worker cut off past the claim deadline comes back after another took its job over: its step (the one
    it retried through the outage, and any later) and its finish write nothing, publish nothing, charge no
    tenant; the job goes on with its new worker."""
    ops, job_id = JobOps(raw, 60), "job_taken_0001"
    _running_job(raw, job_id)  # started by "w"
    vtc = names.partition_prefix(names.job_partition(job_id)) + ":fair:vtc"
    assert _step(ops, job_id, "w", 1, "", "Hi", ("acme", 2.0, 1)) == [StepCode.written]
    assert ops.start(job_id, "w2").code is StartCode.resumed  # claimed: the record names w2 now
    before, charged = _state(raw, job_id), raw.hget(vtc, "acme")

    def stale() -> None:
        assert _step(ops, job_id, "w", 2, "Hi", " there", ("acme", 2.0, 1)) == [StepCode.not_owner]
        assert _step(ops, job_id, "w", 1, "", "Hi") == [StepCode.not_owner]  # not even a replay
        got = ops.finish(job_id, FinishReason.length, fields={"completion_tokens": 2}, worker="w")
        assert got == FinishReply(FinishCode.not_owner)

    assert published(raw, [names.job_channel(job_id)], stale) == []
    assert _state(raw, job_id) == before and raw.hget(vtc, "acme") == charged
    assert _step(ops, job_id, "w2", 2, "Hi", " there") == [StepCode.written]
    assert ops.finish(job_id, FinishReason.length, worker="w2") == FinishReply(FinishCode.finished, 3)
    # the job ended by w2: a late finish of w's is still not w's, so it cannot pass for one of its own sent again
    assert ops.finish(job_id, FinishReason.length, worker="w") == FinishReply(FinishCode.not_owner)
    assert raw.get(names.text_key(job_id)) == b"Hi there"


def test_a_workers_finish_waits_for_its_last_step(raw: redis.Redis) -> None:
    """A worker's finish names what its job's last step wrote (the last chunk's seq, the tokens so far): while
    the record has not reached them (that step lost in a failover, or sent again after the finish, as a cluster
    client resends a pipeline's failed commands one by one), the finish writes nothing and says so, so the
    step is not then refused as one of an ended job and its chunk lost. Once the step landed, it ends the job."""
    ops, job_id = JobOps(raw, 60), "job_behind_0001"
    _running_job(raw, job_id)
    assert _step(ops, job_id, "w", 1, "", "Hi") == [StepCode.written]
    before = _state(raw, job_id)

    def early() -> None:
        for written in ((2, 2), (2, 1), (1, 2)):
            got = ops.finish(job_id, FinishReason.length, fields={"completion_tokens": 2}, worker="w", written=written)
            assert got == FinishReply(FinishCode.behind)

    assert published(raw, [names.job_channel(job_id)], early) == []
    assert _state(raw, job_id) == before
    assert _step(ops, job_id, "w", 2, "Hi", " there") == [StepCode.written]
    got = ops.finish(job_id, FinishReason.length, fields={"completion_tokens": 2}, worker="w", written=(2, 2))
    assert got == FinishReply(FinishCode.finished, 3)
    assert raw.get(names.text_key(job_id)) == b"Hi there"
    # sent again once it went through: the job has ended (not behind, though a later step could be)
    assert ops.finish(job_id, FinishReason.length, worker="w", written=(9, 9)) == FinishReply(FinishCode.already_ended)


def test_a_step_on_an_ended_job_writes_nothing(raw: redis.Redis) -> None:
    ops, job_id = JobOps(raw, 60), "job_ended_0001"
    _running_job(raw, job_id)
    assert _step(ops, job_id, "w", 1, "", "Hi") == [StepCode.written]
    assert ops.finish(job_id, FinishReason.cancelled, worker="w") == FinishReply(FinishCode.finished, 2)
    before = _state(raw, job_id)

    def late() -> None:  # a step the engine made before it heard of the cancel
        assert _step(ops, job_id, "w", 3, "Hi", " more") == [StepCode.ended]

    assert published(raw, [names.job_channel(job_id)], late) == []
    assert _state(raw, job_id) == before


def test_a_job_whose_keys_were_damaged_fails_alone(raw: redis.Redis) -> None:
    """A key of one job that is not of its type (its event stream overwritten by hand) fails that job's part of a
    step call as a gap, and only it: the other jobs of the call are written (the whole call used to fail, every step,
    for every job of the partition). Its finish still ends it: status, the ended stream, its tenant's count."""
    ops = JobOps(raw, 60)
    jobs = ("job_dmg_0001", "job_dmg_0002", "job_dmg_0003")
    for job_id in jobs:
        _running_job(raw, job_id)
    raw.delete(names.events_key("job_dmg_0002"))
    raw.set(names.events_key("job_dmg_0002"), "damaged")
    keys: list[str] = []
    args: list[Any] = []
    for job_id in jobs:
        k, a = step_write(job_id, FRESH | FIRST_TOKEN, 0, pack_ids([7]), 0, b"Hi", 1, b"{}", 1, worker="w")
        keys, args = keys + k, args + a
    pipe = raw.pipeline(transaction=True)
    ops.step(keys, args, pipe)
    [reply] = pipe.execute()
    assert StepReply.parse(reply) == StepReply((StepCode.written, StepCode.gap, StepCode.written))
    assert [raw.get(names.text_key(j)) for j in jobs[::2]] == [b"Hi", b"Hi"]
    assert raw.hget(names.job_key("job_dmg_0002"), "seq") == b"0"  # its chunk not recorded
    ended = raw.xlen(names.stream(names.ENDED, 0))
    assert ops.fail("job_dmg_0002", "its output could not be recorded", "w").code is FinishCode.finished
    assert raw.hget(names.job_key("job_dmg_0002"), "status") == b"failed"
    assert raw.xlen(names.stream(names.ENDED, 0)) == ended + 1  # the after-job work sees it end


def test_one_step_call_writes_each_job_it_may(raw: redis.Redis) -> None:
    """A call of many jobs answers for each: the jobs refused have nothing written, the others are written."""
    ops = JobOps(raw, 60)
    for job_id in ("job_mix_0001", "job_mix_0002"):
        _running_job(raw, job_id)
    keys: list[str] = []
    args: list[Any] = []
    for job_id in ("job_mix_0001", "job_mix_gone", "job_mix_0002"):
        k, a = step_write(job_id, FRESH | FIRST_TOKEN, 0, pack_ids([7]), 0, b"Hi", 1, b"{}", 1, worker="w")
        keys, args = keys + k, args + a
    raw.hset(names.job_key("job_mix_0002"), "worker", "w2")
    pipe = raw.pipeline(transaction=True)
    ops.step(keys, args, pipe)
    [reply] = pipe.execute()
    assert StepReply.parse(reply) == StepReply((StepCode.written, StepCode.no_such_job, StepCode.not_owner))
    assert raw.get(names.text_key("job_mix_0001")) == b"Hi"
    assert raw.exists(*job_keys("job_mix_gone"), names.text_key("job_mix_0002")) == 0


def test_the_ended_stream_is_trimmed_by_age_never_by_count(raw: redis.Redis) -> None:
    """An end that waits (its webhook retrying, no Celery worker reading) stays on `ended` while its record lives,
    however many ends come after it; ends as old as the job TTL go with their records (MINID ~: whole nodes of
    them). A cap by count dropped unhandled ends silently once the stream passed it."""
    ended = names.stream(names.ENDED, 0)
    ops, job_id = JobOps(raw, 3600), "job_aged_0001"
    old = int((time.time() - 7200) * 1000)
    for i in range(300):  # ends of two hours ago: their records, at a TTL of one hour, are gone
        raw.xadd(ended, {"job_id": f"job_old_{i}"}, id=f"{old}-{i}")
    recent = [raw.xadd(ended, {"job_id": f"job_waiting_{i}"}) for i in range(300)]
    _running_job(raw, job_id)
    assert ops.finish(job_id, FinishReason.stop, worker="w").code is FinishCode.finished
    ids = [e for e, _ in raw.xrange(ended)]
    assert set(recent) <= set(ids) and len(ids) < 600 + 1 - 100  # the recent ones all there, old nodes gone
    assert ids[-1] > recent[-1] and raw.xrange(ended, ids[-1])[0][1] == {b"job_id": job_id.encode()}
