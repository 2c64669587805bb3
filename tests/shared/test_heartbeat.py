"""Live workers come from each pool's registry (a sorted set scored by heartbeat expiry), not from a
scan of the keyspace: a worker is listed while its heartbeat lasts, and not after it runs out or stops."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import redis

from infra.redis_server import RedisServer
from shared import names
from shared.heartbeat import Heartbeat, beat, check_pool, forget
from shared.settings import Settings
from shared.signals import read_live, read_snapshot
from tests.helpers import until


def live(r: redis.Redis, pool: str) -> tuple[str, ...]:
    return read_live(r, (pool,))[pool]


def db_url(server: RedisServer) -> str:
    """The URL of redis_db's database."""
    return server.url.rsplit("/", 1)[0] + "/15"


def test_a_worker_is_live_while_its_heartbeat_lasts(redis_db: redis.Redis) -> None:
    hb = Heartbeat(redis_db, "tokenizer", "w1", 0.1, lambda: {"running": 3})
    hb.beat()
    beat(redis_db, "tokenizer", "w2", "1", 100)  # a body that is not a JSON object still counts
    assert live(redis_db, "tokenizer") == ("w1", "w2")
    assert [w.running for w in read_snapshot(redis_db, ("tokenizer",), {}).workers["tokenizer"]] == [3, 0]
    until("both heartbeats to run out (250 ms and 100 ms)", lambda: live(redis_db, "tokenizer") == (), timeout=5)
    assert read_snapshot(redis_db, ("tokenizer",), {}).workers["tokenizer"] == ()
    hb.beat()  # a beat also prunes the ids that ran out
    assert [m for m, _ in redis_db.zrange(names.workers_key("tokenizer"), 0, -1, withscores=True)] == ["w1"]
    hb.stop()
    assert live(redis_db, "tokenizer") == () and not redis_db.exists(names.heartbeat_key("tokenizer", "w1"))


def test_a_worker_that_cannot_do_its_work_is_not_called_live(redis_db: redis.Redis) -> None:
    """A worker whose output lane has not written for WRITE_OUTAGE_S withholds its heartbeat: it drops out of its
    pool once the last one runs out, and is live again with its next write."""
    healthy = [True]
    hb = Heartbeat(redis_db, "inference", "w1", 0.05, lambda: {}, lambda: healthy[0])
    hb.start()
    try:
        until("the worker to be live", lambda: live(redis_db, "inference") == ("w1",), timeout=5)
        healthy[0] = False
        until("its heartbeat to run out", lambda: live(redis_db, "inference") == (), timeout=5)
        healthy[0] = True
        until("the worker to be live again", lambda: live(redis_db, "inference") == ("w1",), timeout=5)
    finally:
        hb.stop()
        hb.join(5)


def test_forget_removes_a_worker_at_once(redis_db: redis.Redis) -> None:
    beat(redis_db, "inference", "w", '{"running": 1}', 60_000)
    forget(redis_db, "inference", "w")
    assert live(redis_db, "inference") == () and not read_snapshot(redis_db, ("inference",), {}).workers["inference"]


def test_live_workers_and_the_probe_read_the_same_beats(redis_db: redis.Redis, redis_server: RedisServer) -> None:
    settings = Settings(redis_url=db_url(redis_server))
    assert not check_pool(settings, "inference")
    hb = Heartbeat(redis_db, "inference", "w", 60, lambda: {"running": 2})
    hb.beat()
    [w] = read_snapshot(redis_db, ("inference",), {}).workers["inference"]
    assert (w.worker_id, w.running, w.host) == ("w", 2, socket.gethostname())
    assert check_pool(settings, "inference") and not check_pool(settings, "tokenizer")
    hb.stop()
    assert not check_pool(settings, "inference")


@pytest.mark.slow
def test_the_probe_restarts_no_worker_for_a_redis_out_of_reach() -> None:
    """A Redis outage is no worker's fault: the probe passes (its beats were unreadable, not missing)."""
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    assert check_pool(Settings(redis_url=f"redis://127.0.0.1:{port}/0"), "inference")


def test_readers_of_live_workers_never_scan_the_keyspace(redis_db: redis.Redis, redis_server: RedisServer) -> None:
    """/readyz, /metrics, /scaling and the signals read the pools' registries, never SCAN or KEYS."""
    import asyncio

    import redis.asyncio as aredis

    from api.metrics import SystemCollector
    from api.routes.health import _readiness

    url = db_url(redis_server)
    raw = redis.Redis.from_url(url)
    beat(redis_db, names.INFERENCE_POOL, "w", '{"running": 2}', 60_000)
    redis_db.config_resetstat()
    assert read_snapshot(raw).pool_signals(8)[names.INFERENCE_POOL].running == 2
    assert list(SystemCollector(redis_db, raw, 0).collect())

    async def ready() -> int:
        client = aredis.Redis.from_url(url, decode_responses=True)
        try:
            return (await _readiness(client, Settings())).status_code
        finally:
            await client.aclose()

    assert asyncio.run(ready()) == 503  # no tokenizer is alive
    calls = set(redis_db.info("commandstats"))
    assert "cmdstat_zrange" in calls
    assert not calls & {"cmdstat_scan", "cmdstat_keys"}
    raw.close()


def test_a_heartbeat_goes_on_through_a_refusal_of_redis_itself(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """Redis refusing writes for a state of its own (`min-replicas-to-write` unmet; a failing save is the same):
    the heartbeat logs it and beats again once Redis takes writes (it used to end its thread, and the worker, alive,
    was counted dead once its key ran out)."""
    server = RedisServer(tmp_path / "redis", appendonly=False)
    server.start()
    r = redis.Redis.from_url(server.url)
    try:
        r.config_set("min-replicas-to-write", 1)
        hb = Heartbeat(r, "pool-refused", "w1", 0.05, lambda: {})
        hb.start()
        until("the refusal to be seen", lambda: "heartbeat failed" in caplog.text)
        r.config_set("min-replicas-to-write", 0)
        until("a beat once Redis takes writes", lambda: r.exists(names.heartbeat_key("pool-refused", "w1")))
        assert hb.is_alive()
        hb.stop()
    finally:
        r.close()
        server.stop()
