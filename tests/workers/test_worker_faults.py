"""Workers fail a bad job alone: the tokenizer ends it with its reason and queues its batch-mates in the
fair queue; an inference entry that comes back after a crash is split into one entry per job.
Real Redis (a database of its own), the real tokenizer."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
import redis

from gpu_worker.worker import InferenceWorker
from shared import names
from shared.jobs import new_record
from shared.schemas import TOKENIZED_SCHEMA, Request, batch_requests, from_ipc, requests_batch, to_ipc
from shared.settings import Settings
from shared.stream_consumer import Entry
from tests.helpers import until
from workers.tokenizer.worker import TokenizerWorker


@pytest.fixture
def settings(redis_server, model_path: str) -> Iterator[Settings]:  # type: ignore[no-untyped-def]
    url = redis_server.url.rsplit("/", 1)[0] + "/12"
    r = redis.Redis.from_url(url)
    r.flushdb()
    yield Settings(redis_url=url, model=model_path, claim_idle_ms=50, max_model_len=1024)
    r.flushdb()
    r.close()


def enqueue(r: redis.Redis, job_id: str, request_json: str) -> None:
    """A job as the API stores it, with whatever request text (an older API, a bug, a hand-made entry)."""
    record = new_record(job_id, "m", request_json)
    r.hset(names.job_key(job_id), mapping={k: v for k, v in record.items() if k != "request"})
    r.xadd(names.stream(names.JOBS, 0), {"job_id": job_id, "request": request_json})


def idle_ms(r: redis.Redis, eid: str) -> int:
    """How long the pending inference entry `eid` has gone undelivered, as Redis counts it."""
    [row] = r.xpending_range(names.stream(names.TOKENIZED, 0), names.INFERENCE_GROUP, min=eid, max=eid, count=1)
    return int(row["time_since_delivered"])


def test_tokenizer_fails_bad_jobs_alone(settings: Settings) -> None:
    w = TokenizerWorker(settings)
    r = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    w.consumer.ensure_group()
    good = {"prompt": "Hello there", "max_tokens": 4}
    enqueue(r, "job_a", json.dumps(good))
    enqueue(r, "job_topk", json.dumps({**good, "top_k": 3_000_000_000}))
    enqueue(r, "job_garbage", "{not json")
    enqueue(r, "job_ids", json.dumps({**good, "stop_token_ids": [99_999_999_999]}))
    enqueue(r, "job_b", json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}))
    enqueue(r, "job_long", json.dumps({"prompt": "word " * 3000, "max_tokens": 4}))
    w.process(w.consumer.read(64, 100))

    for job_id in ("job_topk", "job_garbage", "job_ids", "job_long"):
        rec = r.hgetall(names.job_key(job_id))
        assert rec["status"] == "failed" and rec["error"], (job_id, rec)
    assert "top_k" in r.hget(names.job_key("job_topk"), "error")
    # the good ones wait in the fair queue, in arrival order, each its own tokenized row
    assert r.zrange(names.fair_queue_key(0, names.ANONYMOUS_TENANT), 0, -1) == ["job_a", "job_b"]
    raw = redis.Redis.from_url(settings.redis_url).hgetall(names.fair_key(0, "payload"))
    assert {job_id: from_ipc(row, TOKENIZED_SCHEMA).column("id").to_pylist() for job_id, row in raw.items()} == {
        b"job_a": ["job_a"], b"job_b": ["job_b"]}
    assert r.hget(names.job_key("job_b"), "prompt_tokens") == str(len(
        from_ipc(raw[b"job_b"], TOKENIZED_SCHEMA).column("prompt_ids")[0]))
    assert r.xpending(names.stream(names.JOBS, 0), names.TOKENIZER_GROUP)["pending"] == 0


def test_a_row_arrow_cannot_hold_fails_its_job_alone(settings: Settings) -> None:
    w = TokenizerWorker(settings)
    r = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    for job_id in ("job_ok", "job_overflow"):
        r.hset(names.job_key(job_id), mapping={"id": job_id, "status": "queued", "created_at": time.time()})
    batch = w._record_batch([Request("job_ok", [1, 2], max_tokens=4, temperature=0.0, seed=1),
                             Request("job_overflow", [1, 2], max_tokens=4, seed=1, top_k=3_000_000_000)])
    assert batch is not None and batch.column("id").to_pylist() == ["job_ok"]
    assert r.hget(names.job_key("job_overflow"), "status") == "failed"
    assert r.hget(names.job_key("job_ok"), "status") == "queued"


def test_redelivered_inference_entry_is_split_one_job_each(settings: Settings) -> None:
    r = redis.Redis.from_url(settings.redis_url)
    batch = requests_batch([Request(f"job_{i}", [1, 2, i], max_tokens=4, temperature=0.0, seed=i) for i in range(3)])
    worker = InferenceWorker(settings)
    worker.consumer.ensure_group()
    eid = r.xadd(names.stream(names.TOKENIZED, 0), {"batch": to_ipc(batch), "jobs": 3}).decode()
    r.xreadgroup(names.INFERENCE_GROUP, "inference-dead", {names.stream(names.TOKENIZED, 0): ">"})  # its worker died
    until("the entry to be idle past CLAIM_IDLE_MS", lambda: idle_ms(r, eid) > settings.claim_idle_ms)
    keep, dead = worker.consumer.claim_stale()
    assert [e.id for e in keep] == [eid] and keep[0].deliveries == 2 and not dead
    assert worker.reader.split(keep[0])
    assert r.xpending(names.stream(names.TOKENIZED, 0), names.INFERENCE_GROUP)["pending"] == 0  # the original is acked
    entries = r.xrange(names.stream(names.TOKENIZED, 0))
    singles = [batch_requests(from_ipc(f[b"batch"], TOKENIZED_SCHEMA)) for e, f in entries if e.decode() != eid]
    assert [s[0].id for s in singles] == ["job_0", "job_1", "job_2"] and all(len(s) == 1 for s in singles)
    assert singles[1] == batch_requests(batch)[1:2]
    # a single-job entry is not split again: it goes to the engine, and past the limit to the dead letters
    one = r.xrange(names.stream(names.TOKENIZED, 0))[-1]
    assert not worker.reader.split(Entry(one[0].decode(), one[1], 2))
