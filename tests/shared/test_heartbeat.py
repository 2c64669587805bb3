"""Live workers come from each pool's registry (a sorted set scored by heartbeat expiry), not from a
scan of the keyspace: a worker is listed while its heartbeat lasts, and not after it runs out or stops."""

from __future__ import annotations

import time

import redis

from shared import names
from shared.heartbeat import Heartbeat, beat, forget, live_ids, live_workers


def test_a_worker_is_live_while_its_heartbeat_lasts(redis_db: redis.Redis) -> None:
    hb = Heartbeat(redis_db, "tokenizer", "w1", 0.1, lambda: {"running": 3})
    hb.beat()
    beat(redis_db, "tokenizer", "w2", "1", 100)  # a body that is not a JSON object still counts
    assert sorted(live_ids(redis_db, "tokenizer")) == ["w1", "w2"]
    assert sorted(w.get("running", 0) for w in live_workers(redis_db, "tokenizer")) == [0, 3]
    time.sleep(0.3)  # both heartbeats ran out (250 ms and 100 ms)
    assert live_ids(redis_db, "tokenizer") == [] and live_workers(redis_db, "tokenizer") == []
    hb.beat()  # a beat also prunes the ids that ran out
    assert [m for m, _ in redis_db.zrange(names.workers_key("tokenizer"), 0, -1, withscores=True)] == ["w1"]
    hb.stop()
    assert live_ids(redis_db, "tokenizer") == [] and not redis_db.exists(names.heartbeat_key("tokenizer", "w1"))


def test_forget_removes_a_worker_at_once(redis_db: redis.Redis) -> None:
    beat(redis_db, "inference", "w", '{"running": 1}', 60_000)
    forget(redis_db, "inference", "w")
    assert live_workers(redis_db, "inference") == []


def test_readers_of_live_workers_never_scan_the_keyspace(redis_db: redis.Redis, redis_server) -> None:  # type: ignore[no-untyped-def]
    """/readyz, /metrics, /scaling and the signals read the pools' registries, never SCAN or KEYS."""
    import asyncio

    import redis.asyncio as aredis

    from api.metrics import SystemCollector
    from api.routes.health import _readiness
    from shared.signals import pool_signals

    url = redis_server.url.rsplit("/", 1)[0] + "/15"  # redis_db's database
    raw = redis.Redis.from_url(url)
    beat(redis_db, names.INFERENCE_POOL, "w", '{"running": 2}', 60_000)
    redis_db.config_resetstat()
    assert pool_signals(raw, 8)[names.INFERENCE_POOL].running == 2
    assert list(SystemCollector(redis_db, raw, 0).collect())

    async def ready() -> int:
        client = aredis.Redis.from_url(url, decode_responses=True)
        try:
            return (await _readiness(client)).status_code
        finally:
            await client.aclose()

    assert asyncio.run(ready()) == 503  # no tokenizer is alive
    calls = set(redis_db.info("commandstats"))
    assert "cmdstat_zrangebyscore" in calls or "cmdstat_zcount" in calls
    assert not calls & {"cmdstat_scan", "cmdstat_keys"}
    raw.close()
