"""Workers fail a bad job alone: the tokenizer ends it with its reason and queues its batch-mates in the
fair queue, each as its own `tokenized` record. Real Redis (a database of its own), the real tokenizer."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from shared import names
from shared.jobs import new_record
from shared.schemas import decode_request
from shared.settings import Settings
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
    # the good ones wait in the fair queue, each its own tokenized record
    raw = redis.Redis.from_url(settings.redis_url).hgetall(names.fair_key(0, "payload"))
    assert {job_id: decode_request(row).id for job_id, row in raw.items()} == {b"job_a": "job_a", b"job_b": "job_b"}
    assert r.hget(names.job_key("job_b"), "prompt_tokens") == str(len(decode_request(raw[b"job_b"]).prompt_ids))
    assert r.xpending(names.stream(names.JOBS, 0), names.TOKENIZER_GROUP)["pending"] == 0


def test_an_entry_our_api_did_not_write_fails_its_job_alone_with_its_reason(settings: Settings) -> None:
    """The tokenizer trusts the door and does not validate again; an entry of another shape still fails only its
    own job, saying why, and a value past a bound the door keeps travels on to the engine, which refuses it
    (Request.out_of_bounds)."""
    w = TokenizerWorker(settings)
    r = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    w.consumer.ensure_group()
    good = {"prompt": "Hello there", "max_tokens": 4}
    bad = {"job_list": "[1, 2]", "job_unknown": json.dumps({**good, "nonsense": 1}),
           "job_none": json.dumps({"max_tokens": 4}), "job_role": json.dumps({"messages": [{"role": "user"}]}),
           "job_type": json.dumps({**good, "max_tokens": "many"}), "job_prompt": json.dumps({"prompt": 5}),
           "job_seed": json.dumps({**good, "seed": "x"}), "job_ids": json.dumps({"prompt_token_ids": ["a"]})}
    enqueue(r, "job_a", json.dumps(good))
    for job_id, raw in bad.items():
        enqueue(r, job_id, raw)
    enqueue(r, "job_hot", json.dumps({**good, "temperature": 50.0}))
    w.process(w.consumer.read(64, 100))

    for job_id in bad:
        rec = r.hgetall(names.job_key(job_id))
        assert rec["status"] == "failed" and rec["error"], (job_id, rec)
    for job_id, field in (("job_unknown", "nonsense"), ("job_type", "max_tokens"), ("job_seed", "seed"),
                          ("job_prompt", "prompt"), ("job_role", "content"), ("job_ids", "prompt_ids")):
        assert field in r.hget(names.job_key(job_id), "error"), job_id
    assert set(r.hkeys(names.fair_key(0, "payload"))) == {"job_a", "job_hot"}
    hot = decode_request(redis.Redis.from_url(settings.redis_url).hget(names.fair_key(0, "payload"), "job_hot"))
    assert hot.temperature == 50.0 and hot.out_of_bounds() == "temperature is out of its bounds"
    assert r.xpending(names.stream(names.JOBS, 0), names.TOKENIZER_GROUP)["pending"] == 0


def _shaped_json() -> str:
    """A job with a grammar, as the API stores it."""
    from shared.schemas import GenerationRequest

    shaped = GenerationRequest(prompt="Name a color.", max_tokens=8, response_format={"type": "json_object"})
    return shaped.model_dump_json(exclude_none=True)


def _has_group(r: redis.Redis, stream: str, group: str) -> bool:
    try:
        return any(g["name"] == group for g in r.xinfo_groups(stream))
    except redis.ResponseError:  # no stream yet
        return False


@contextlib.contextmanager
def _worker_with_held_compiles(settings: Settings, monkeypatch: pytest.MonkeyPatch
                               ) -> Iterator[tuple[redis.Redis, threading.Event, threading.Event]]:
    """A running tokenizer worker whose compiles wait until `release` is set (`compiling`: one began); yields
    (a decoding client, compiling, release) and stops the worker on leaving."""
    w = TokenizerWorker(settings)
    compiling, release = threading.Event(), threading.Event()
    compile_one = w._compile

    def held(job_id: str, req: Any, served: Any) -> bool:
        compiling.set()
        release.wait(60)
        return compile_one(job_id, req, served)

    monkeypatch.setattr(w, "_compile", held)
    runner = threading.Thread(target=w.run, daemon=True)
    runner.start()
    r = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    try:
        # its consumer group made (a job enqueued before is read all the same: the group starts at 0), so that the
        # tests can read the group's pending entries at once
        until("the worker's consumer group", lambda: _has_group(r, names.stream(names.JOBS, 0),
                                                                names.TOKENIZER_GROUP), timeout=30)
        yield r, compiling, release
    finally:
        release.set()
        w.stop_event.set()
        runner.join(60)


def test_a_grammar_compiling_holds_no_other_job(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """A running worker compiles grammars in its compile lane: while one compiles (up to seconds), the jobs read
    after it, of any tenant or model, are queued; the job with the grammar is queued once compiled, its entry
    kept from going idle meanwhile (here CLAIM_IDLE_MS is 50 ms: it was taken up again and dead-lettered)."""
    with _worker_with_held_compiles(settings, monkeypatch) as (r, compiling, release):
        enqueue(r, "job_shaped", _shaped_json())
        assert compiling.wait(30)
        enqueue(r, "job_plain", json.dumps({"prompt": "Hello there", "max_tokens": 4}))
        until("the plain job queued while the grammar compiles", lambda: r.hexists(names.fair_key(0, "payload"),
                                                                                    "job_plain"), timeout=30)
        assert not r.hexists(names.fair_key(0, "payload"), "job_shaped")
        release.set()
        until("the job with the grammar queued", lambda: r.hexists(names.fair_key(0, "payload"), "job_shaped"),
              timeout=60)
    assert r.xpending(names.stream(names.JOBS, 0), names.TOKENIZER_GROUP)["pending"] == 0


def test_a_full_compile_lane_holds_no_other_job(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """A flood of jobs with grammars (one tenant's distinct schemas, say) fills the compile lane: the loop goes on
    reading and queuing the other jobs, and keeps the jobs with a grammar it has no room for pending (refreshed,
    not taken up again) until the lane has room. Before, the loop waited for room, holding every client's jobs
    behind the compiles."""
    from workers.tokenizer.worker import SHAPED_WAITING

    flood = [f"job_shaped_{i}" for i in range(SHAPED_WAITING + 4)]
    with _worker_with_held_compiles(settings, monkeypatch) as (r, _, release):
        for n, job_id in enumerate(flood, 1):  # one read each: a batch each for the lane, until it is full
            enqueue(r, job_id, _shaped_json())
            until("the job read", lambda n=n: r.xpending(names.stream(names.JOBS, 0),
                                                         names.TOKENIZER_GROUP)["pending"] >= n, timeout=30)
        enqueue(r, "job_plain", json.dumps({"prompt": "Hello there", "max_tokens": 4}))
        until("the plain job queued while the lane is full", lambda: r.hexists(names.fair_key(0, "payload"),
                                                                               "job_plain"), timeout=30)
        assert not any(r.hexists(names.fair_key(0, "payload"), j) for j in flood)
        release.set()
        until("every job with a grammar queued", lambda: all(r.hexists(names.fair_key(0, "payload"), j)
                                                             for j in flood), timeout=120)
    assert r.xpending(names.stream(names.JOBS, 0), names.TOKENIZER_GROUP)["pending"] == 0
    assert not any(r.hget(names.job_key(j), "status") == "failed" for j in flood)
