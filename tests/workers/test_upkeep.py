"""Stream trimming keeps only entries still in flight; the Celery app schedules the upkeep and after-job work."""

from __future__ import annotations

import redis

from shared import names
from workers import upkeep
from workers.upkeep import prune_consumers, trim_consumed


def test_trim_keeps_pending_and_undelivered(redis_db: redis.Redis) -> None:
    r = redis_db
    s, g = names.stream(names.JOBS, 0), names.TOKENIZER_GROUP
    r.xgroup_create(s, g, id="0", mkstream=True)
    ids = [r.xadd(s, {"n": i}) for i in range(10)]
    got = r.xreadgroup(g, "c1", {s: ">"}, count=6)[0][1]
    assert len(got) == 6
    r.xack(s, g, *ids[:3])  # 0-2 done, 3-5 pending, 6-9 undelivered
    assert trim_consumed(r, s, g) == 3
    assert [e for e, _ in r.xrange(s)] == ids[3:]
    r.xack(s, g, *ids[3:6])
    trim_consumed(r, s, g)
    assert [e for e, _ in r.xrange(s)] == ids[6:]  # undelivered entries are never dropped
    r.xreadgroup(g, "c1", {s: ">"})
    r.xack(s, g, *ids[6:])
    assert upkeep.run(r).trimmed[s] == 4 and r.xlen(s) == 0
    assert trim_consumed(r, f"{names.PREFIX}:none", g) == 0


def test_consumers_gone_are_pruned_but_never_one_that_holds_entries(redis_db: redis.Redis) -> None:
    r = redis_db
    s, g = names.stream(names.JOBS, 0), names.TOKENIZER_GROUP
    r.xgroup_create(s, g, id="0", mkstream=True)
    r.xadd(s, {"n": 1})
    r.xadd(s, {"n": 2})
    [(_, [(done, _)])] = r.xreadgroup(g, "gone", {s: ">"}, count=1)
    r.xack(s, g, done)
    r.xreadgroup(g, "holds", {s: ">"}, count=1)  # pending, unacknowledged: its worker may have died with it
    assert prune_consumers(r, s, g) == 0  # both read just now
    assert prune_consumers(r, s, g, idle_ms=0) == 1
    assert [c["name"] for c in r.xinfo_consumers(s, g)] == ["holds"]
    assert upkeep.run(r, idle_ms=0).pruned == 0 and prune_consumers(r, f"{names.PREFIX}:none", g, idle_ms=0) == 0


def test_celery_app_registers_tasks() -> None:
    from workers.celery_app import app

    assert {"conveyor.trim_streams", "conveyor.after_jobs"} <= set(app.tasks)
    assert {e["task"] for e in app.conf.beat_schedule.values()} == {"conveyor.trim_streams", "conveyor.after_jobs"}


def test_stream_trimming_has_one_owner() -> None:
    """Beat's upkeep task trims; the tokenizer workers no longer do."""
    import workers.tokenizer.worker as tokenizer

    assert not hasattr(tokenizer, "trim_all") and not hasattr(tokenizer, "upkeep")


def test_trim_with_a_binary_client(redis_server) -> None:  # type: ignore[no-untyped-def]
    raw = redis.Redis.from_url(redis_server.url.rsplit("/", 1)[0] + "/14")
    raw.flushdb()
    s, g = names.stream(names.TOKENIZED, 0), names.INFERENCE_GROUP
    raw.xgroup_create(s, g, id="0", mkstream=True)
    ids = [raw.xadd(s, {"batch": b"\xff\x00"}) for _ in range(3)]
    raw.xreadgroup(g, "c", {s: ">"})
    raw.xack(s, g, ids[0])
    assert trim_consumed(raw, s, g) == 1
    raw.flushdb()
