"""The signals reader: group lags against the real redis-server (6.2: no `lag` in XINFO GROUPS) and
the Redis 7 replies, the one test of liveness, heartbeats parsed into typed values, and the snapshot
every reader takes."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio as aredis

from infra.redis_server import free_port
from shared import names, signals
from shared.heartbeat import beat
from shared.policy import PoolSignals
from shared.settings import Settings
from shared.signals import (
    COUNT_LIMIT,
    GroupLag,
    Uncounted,
    WorkerBeat,
    aread_live,
    is_live,
    lag_per_replica,
    parse_beat,
    parse_group,
    parse_registry,
    read_live,
    read_snapshot,
)

STREAM, GROUP = "test:stream", "workers"


@pytest.fixture(params=["str", "bytes"])
def client(request: pytest.FixtureRequest, redis_db: redis.Redis) -> Iterator[redis.Redis]:
    """The flushed db 15, through a client that decodes responses and through one that does not."""
    if request.param == "str":
        yield redis_db
        return
    kwargs = redis_db.connection_pool.connection_kwargs
    raw = redis.Redis(host=kwargs["host"], port=kwargs["port"], db=kwargs["db"], password=kwargs.get("password"),
                      decode_responses=False)
    yield raw
    raw.close()


def group_lag(client: redis.Redis, stream: str = STREAM, group: str = GROUP, limit: int = COUNT_LIMIT) -> GroupLag:
    return read_snapshot(client, (), {stream: group}, limit).lags[stream]


def add(client: redis.Redis, n: int, stream: str = STREAM) -> list[str]:
    ids = [client.xadd(stream, {"payload": "x" * 300, "i": i}) for i in range(n)]
    return [i.decode() if isinstance(i, bytes) else str(i) for i in ids]


def read(client: redis.Redis, n: int, consumer: str = "c1") -> list[str]:
    reply: Any = client.xreadgroup(GROUP, consumer, {STREAM: ">"}, count=n)
    entries = reply[0][1] if reply else []
    return [e[0].decode() if isinstance(e[0], bytes) else e[0] for e in entries]


def test_missing_stream(client: redis.Redis) -> None:
    assert group_lag(client, STREAM, GROUP) == (0, 0)


def test_stream_without_the_group_counts_every_entry(client: redis.Redis) -> None:
    add(client, 4)
    assert group_lag(client, STREAM, GROUP) == (4, 0)


def test_empty_stream(client: redis.Redis) -> None:
    client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    assert group_lag(client, STREAM, GROUP) == (0, 0)


def test_entries_before_the_group_count_when_it_starts_at_zero(client: redis.Redis) -> None:
    add(client, 5)
    client.xgroup_create(STREAM, GROUP, id="0")
    assert group_lag(client, STREAM, GROUP) == (5, 0)
    add(client, 3)
    assert group_lag(client, STREAM, GROUP) == (8, 0)


def test_entries_before_the_group_do_not_count_when_it_starts_at_the_end(client: redis.Redis) -> None:
    add(client, 5)
    client.xgroup_create(STREAM, GROUP, id="$")
    assert group_lag(client, STREAM, GROUP) == (0, 0)
    add(client, 2)
    assert group_lag(client, STREAM, GROUP) == (2, 0)


def test_reading_moves_lag_to_pending_and_acking_clears_it(client: redis.Redis) -> None:
    client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    add(client, 10)
    taken = read(client, 3)
    assert len(taken) == 3
    assert group_lag(client, STREAM, GROUP) == (7, 3)
    taken += read(client, 4, consumer="c2")
    assert group_lag(client, STREAM, GROUP) == (3, 7)
    client.xack(STREAM, GROUP, *taken[:5])
    assert group_lag(client, STREAM, GROUP) == (3, 2)
    taken += read(client, 10)
    client.xack(STREAM, GROUP, *taken)
    assert group_lag(client, STREAM, GROUP) == (0, 0)


def test_deleted_and_trimmed_entries_no_longer_count(client: redis.Redis) -> None:
    client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    ids = add(client, 6)
    read(client, 2)
    client.xdel(STREAM, ids[3])
    assert group_lag(client, STREAM, GROUP) == (3, 2)
    client.xtrim(STREAM, maxlen=2, approximate=False)
    assert group_lag(client, STREAM, GROUP) == (2, 2)


def test_counting_pages_and_stops_at_the_limit(client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(signals, "PAGE", 7)  # several pages, and a last one cut short by the limit
    client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    add(client, 51)
    read(client, 1)
    assert group_lag(client, STREAM, GROUP) == (50, 1)
    assert group_lag(client, STREAM, GROUP, limit=20) == (20, 1)
    assert group_lag(client, STREAM, GROUP, limit=49) == (49, 1)


def test_other_groups_do_not_interfere(client: redis.Redis) -> None:
    client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    client.xgroup_create(STREAM, "others", id="0")
    add(client, 4)
    client.xreadgroup("others", "o", {STREAM: ">"}, count=4)
    assert group_lag(client, STREAM, GROUP) == (4, 0)
    assert group_lag(client, STREAM, "others") == (0, 4)


def test_pool_signals_read_every_pool_stream(client: redis.Redis) -> None:
    """The tokenizer pool's load is its jobs and its tokenize calls (/tokenize, count_tokens): a flood of either
    scales it."""
    client.xgroup_create(names.stream(names.JOBS, 0), names.TOKENIZER_GROUP, id="0", mkstream=True)
    add(client, 3, stream=names.stream(names.JOBS, 0))
    add(client, 2, stream=names.stream(names.TOKENIZE, 0))
    add(client, 1, stream=names.stream(names.TOKENIZED, 0))
    snap = read_snapshot(client)
    assert snap.lags == {names.stream(names.JOBS, 0): (3, 0), names.stream(names.TOKENIZE, 0): (2, 0),
                         names.stream(names.TOKENIZED, 0): (1, 0), names.stream(names.ENDED, 0): (0, 0)}
    assert snap.pool_signals(64) == {names.TOKENIZER_POOL: PoolSignals(5, 0),
                                     names.INFERENCE_POOL: PoolSignals(1, 0, 0, 64)}


def test_a_wrong_type_is_an_error(client: redis.Redis) -> None:
    client.set(STREAM, "not a stream")
    with pytest.raises(redis.ResponseError):
        group_lag(client, STREAM, GROUP)


def test_binary_entries_through_a_decoding_client(client: redis.Redis) -> None:
    client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    for _ in range(6):
        client.xadd(STREAM, {"batch": b"\xff\xfe\x00arrow", "jobs": 1})
    raw = redis.Redis(connection_pool=redis.ConnectionPool(**{**client.connection_pool.connection_kwargs,
                                                               "decode_responses": False}))
    raw.xreadgroup(GROUP, "c1", {STREAM: ">"}, count=2)
    assert group_lag(client, STREAM, GROUP) == (4, 2)
    raw.close()


def redis7_groups(lag: int | None, last_id: str | bytes = "5-0") -> list[dict[str, Any]]:
    """XINFO GROUPS as Redis 7 answers it, `entries-read` and `lag` included."""
    return [{"name": "others", "consumers": 0, "pending": 0, "last-delivered-id": "0-0", "entries-read": 0,
             "lag": 9},
            {"name": GROUP, "consumers": 1, "pending": 1, "last-delivered-id": last_id, "entries-read": None,
             "lag": lag}]


def test_redis7_lag_field_is_used_when_present() -> None:
    assert parse_group(redis7_groups(42), 5, GROUP) == GroupLag(42, 1)


def test_redis7_null_lag_is_counted_after_the_last_delivered_id() -> None:
    assert parse_group(redis7_groups(None, b"5-0"), 5, GROUP) == Uncounted("5-0", 1)
    assert parse_group(redis7_groups(None, "0-0"), 5, GROUP) == GroupLag(5, 1)  # nothing delivered: all of it


def test_a_missing_stream_and_a_missing_group_need_no_count() -> None:
    assert parse_group(redis.ResponseError("no such key"), 0, GROUP) == GroupLag(0, 0)
    assert parse_group(redis7_groups(3), 7, "absent") == GroupLag(7, 0)
    with pytest.raises(redis.ResponseError):
        parse_group(redis.ResponseError("WRONGTYPE"), 0, GROUP)


@pytest.fixture(scope="module")
def redis7(tmp_path_factory: pytest.TempPathFactory) -> Iterator[redis.Redis]:
    """A Redis 7 server from PATH, where one is installed (the embedded one is 6.2)."""
    binary = shutil.which("redis-server")
    version = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout if binary else ""
    match = re.search(r"v=(\d+)\.", version)
    if binary is None or match is None or int(match.group(1)) < 7:
        pytest.skip("no redis-server 7 on PATH")
    port = free_port()
    data = str(tmp_path_factory.mktemp("redis7"))
    args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", data]
    proc = subprocess.Popen([binary, *args], stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port, decode_responses=True)
    try:
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        yield client
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)


def test_redis7_real_server(redis7: redis.Redis) -> None:
    redis7.flushdb()
    ids = add(redis7, 10)
    redis7.xgroup_create(STREAM, GROUP, id="0")
    assert redis7.xinfo_groups(STREAM)[0]["lag"] == 10
    assert group_lag(redis7, STREAM, GROUP) == (10, 0)
    read(redis7, 3)
    assert group_lag(redis7, STREAM, GROUP) == (7, 3)
    redis7.xdel(STREAM, ids[6])  # a hole after the group's position: Redis 7 answers lag NULL
    assert redis7.xinfo_groups(STREAM)[0]["lag"] is None
    assert group_lag(redis7, STREAM, GROUP) == (6, 3)


def test_live_means_the_registry_score_is_still_ahead() -> None:
    assert is_live(10.5, 10.0) and not is_live(10.0, 10.0) and not is_live(9.0, 10.0) and not is_live(None, 10.0)
    reply = [(b"w2", 12.0), ("w1", 11.0), ("gone", 9.0), ("now", 10.0)]
    assert parse_registry(reply, 10.0) == ("w1", "w2")


def test_heartbeats_parse_into_typed_gauges() -> None:
    body = b'{"pid": 7, "host": "h", "running": 2, "waiting": 1, "kv_cache_usage": 0.5, "steps": 9, ' \
           b'"generated_tokens": 40, "jobs_started": 3, "preemptions": 5, "fair_preemptions": 1, ' \
           b'"priority_preemptions": 2}'
    assert parse_beat("inference", "w", body) == WorkerBeat("inference", "w", 7, "h", 2, 1, 0.5, 9, 40, 5, 1, 2)
    assert parse_beat("inference", "w", body).held == 3
    assert parse_beat("inference", "w", body).batch_invariant  # a body that does not say so (an older worker's)
    assert not parse_beat("inference", "w", body[:-1] + b', "batch_invariant": false}').batch_invariant
    for empty in (None, "", "1", "[1]", "{not json", '{"running": "2", "pid": "7"}'):
        assert parse_beat("celery", "c", empty) == WorkerBeat("celery", "c"), empty


def test_lag_per_replica_comes_from_the_settings() -> None:
    s = Settings(tokenizer_lag_per_replica=5, inference_lag_per_replica=3)
    assert lag_per_replica(s) == {names.TOKENIZER_POOL: 5, names.INFERENCE_POOL: 3}


def test_a_snapshot_holds_live_workers_and_their_heartbeats(client: redis.Redis) -> None:
    beat(client, names.INFERENCE_POOL, "i2", '{"pid": 2, "running": 3, "waiting": 1}', 60_000)
    beat(client, names.INFERENCE_POOL, "i1", '{"pid": 1, "running": 1, "kv_cache_usage": 0.25}', 60_000)
    beat(client, names.CELERY_POOL, "c", "1", 60_000)
    client.zadd(names.workers_key(names.TOKENIZER_POOL), {"ran-out": time.time() - 1})
    client.set(names.heartbeat_key(names.TOKENIZER_POOL, "unlisted"), "{}")  # a key alone is not a live worker
    snap = read_snapshot(client)
    assert snap.workers == {
        names.TOKENIZER_POOL: (),
        names.INFERENCE_POOL: (WorkerBeat(names.INFERENCE_POOL, "i1", 1, running=1, kv_cache_usage=0.25),
                               WorkerBeat(names.INFERENCE_POOL, "i2", 2, running=3, waiting=1)),
        names.CELERY_POOL: (WorkerBeat(names.CELERY_POOL, "c"),),
    }
    assert snap.pool_signals(8)[names.INFERENCE_POOL] == PoolSignals(0, 0, running=5, capacity_per_replica=8)
    assert read_live(client) == {pool: tuple(w.worker_id for w in ws) for pool, ws in snap.workers.items()}


def test_the_async_reader_sees_the_same_live_workers(client: redis.Redis) -> None:
    beat(client, names.TOKENIZER_POOL, "t", "{}", 60_000)
    beat(client, names.INFERENCE_POOL, "i", "{}", 60_000)
    kwargs = client.connection_pool.connection_kwargs

    async def live() -> dict[str, tuple[str, ...]]:
        async_client = aredis.Redis(host=kwargs["host"], port=kwargs["port"], db=kwargs["db"],
                                    password=kwargs.get("password"), decode_responses=kwargs["decode_responses"])
        try:
            return await aread_live(async_client)
        finally:
            await async_client.aclose()

    expected = {names.TOKENIZER_POOL: ("t",), names.INFERENCE_POOL: ("i",), names.CELERY_POOL: ()}
    assert asyncio.run(live()) == read_live(client) == expected
