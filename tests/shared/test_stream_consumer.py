"""At-least-once consumption: only a dead consumer's entries are taken over; a poison entry
ends in the dead-letter stream after the delivery limit."""

from __future__ import annotations

import redis

from shared import names
from shared.heartbeat import beat, forget
from shared.stream_consumer import StreamConsumer
from tests.helpers import until

S, G, POOL = names.stream(names.JOBS, 0), names.TOKENIZER_GROUP, names.TOKENIZER_POOL


def consumer(r: redis.Redis, name: str, limit: int = 3) -> StreamConsumer:
    c = StreamConsumer(r, S, G, name, POOL, claim_idle_ms=50, delivery_limit=limit)
    c.ensure_group()
    return c


def idle(r: redis.Redis, ms: int = 50) -> None:
    """Wait until every pending entry has been idle `ms` or more."""
    until(f"pending entries idle {ms} ms", lambda: all(
        p["time_since_delivered"] >= ms for p in r.xpending_range(S, G, min="-", max="+", count=100)))


def test_live_owner_keeps_its_entries(redis_db: redis.Redis) -> None:
    a, b = consumer(redis_db, "a"), consumer(redis_db, "b")
    beat(redis_db, POOL, "a", "{}", 60_000)
    eid = redis_db.xadd(S, {"job_id": "j1"})
    assert [e.id for e in a.read(10, 100)] == [eid]
    idle(redis_db)
    assert b.claim_stale() == ([], [])  # idle, but its owner is alive
    forget(redis_db, POOL, "a")
    keep, dead = b.claim_stale()
    assert [(e.id, e.deliveries) for e in keep] == [(eid, 2)] and not dead


def test_liveness_is_the_registry_score_not_the_heartbeat_key(redis_db: redis.Redis) -> None:
    a, b = consumer(redis_db, "a"), consumer(redis_db, "b")
    redis_db.set(names.heartbeat_key(POOL, "a"), "{}")  # a key left behind, its registry entry run out
    redis_db.zadd(names.workers_key(POOL), {"a": 1.0})
    eid = redis_db.xadd(S, {"job_id": "j1"})
    a.read(10, 100)
    idle(redis_db)
    keep, dead = b.claim_stale()
    assert [e.id for e in keep] == [eid] and not dead


def test_poison_entry_dead_lettered_after_limit(redis_db: redis.Redis) -> None:
    eid = redis_db.xadd(S, {"job_id": "poison"})
    first = consumer(redis_db, "c0", limit=2)
    assert first.read(10, 100)[0].id == eid  # delivery 1, then the consumer "dies"
    deliveries = []
    for i in range(1, 4):
        idle(redis_db)
        keep, dead = consumer(redis_db, f"c{i}", limit=2).claim_stale()
        deliveries += [e.deliveries for e in keep]
        if dead:
            break
    assert deliveries == [2]
    assert [e.id for e in dead] == [eid]
    entries = redis_db.xrange(names.stream(names.DEAD, 0))
    assert entries[0][1]["source_id"] == eid and entries[0][1]["job_id"] == "poison"
    assert redis_db.xpending(S, G)["pending"] == 0


def test_a_dead_entrys_job_ends_before_the_entry_is_acknowledged(redis_db: redis.Redis) -> None:
    """Past the delivery limit, `on_dead` (the job's failure) runs first: while it fails (Redis out between the
    two calls, say), the entry stays pending and no dead letter is written, so the next claim tries again; an entry
    acknowledged before its job ended would leave the job queued or running until its TTL."""
    eid = redis_db.xadd(S, {"job_id": "poison"})
    consumer(redis_db, "c0", limit=1).read(10, 100)  # delivery 1, then the consumer "dies"
    ended: list[str] = []

    def end_job(entry: object) -> None:
        if not ended:
            ended.append("refused")
            raise redis.ConnectionError("redis unavailable")
        ended.append(entry.fields["job_id"])  # type: ignore[attr-defined]

    for attempt in range(2):
        idle(redis_db)
        c = consumer(redis_db, f"c{attempt + 1}", limit=1)
        c.on_dead = end_job
        if attempt == 0:
            try:
                c.claim_stale()
            except redis.ConnectionError:
                pass
            assert redis_db.xpending(S, G)["pending"] == 1 and not redis_db.exists(names.stream(names.DEAD, 0))
        else:
            keep, dead = c.claim_stale()
            assert not keep and [e.id for e in dead] == [eid]
    assert ended == ["refused", "poison"]
    assert redis_db.xpending(S, G)["pending"] == 0 and redis_db.xlen(names.stream(names.DEAD, 0)) == 1


def test_refresh_keeps_long_work(redis_db: redis.Redis) -> None:
    a, b = consumer(redis_db, "a"), consumer(redis_db, "b")
    eid = redis_db.xadd(S, {"job_id": "long"})
    a.read(10, 100)
    idle(redis_db, 80)
    a.refresh([(S, eid)])
    b.claim_idle_ms = 80
    assert b.claim_stale() == ([], [])  # refreshed just now: not idle enough


def test_outage_holds_claims_back(redis_db: redis.Redis) -> None:
    a, b = consumer(redis_db, "a"), consumer(redis_db, "b")
    redis_db.xadd(S, {"job_id": "x"})
    a.read(10, 100)
    idle(redis_db)
    b.claim_idle_ms = 5000
    b.note_outage()
    b.claim_idle_ms = 50
    assert b.claim_stale() == ([], [])


def test_a_poison_entry_that_kills_its_workers_is_dead_lettered_alone(redis_db: redis.Redis) -> None:
    """Workers die while handling one entry of a batch. Entries already delivered twice are
    claimed one at a time, so the poison reaches the limit alone and every batch-mate is done."""
    ids = [redis_db.xadd(S, {"job_id": f"j{i}"}) for i in range(6)]
    poison = ids[2]
    consumer(redis_db, "c0").read(10, 100)  # the first worker dies holding the whole batch
    done: list[str] = []
    dead_lettered: list[str] = []
    for n in range(1, 10):
        idle(redis_db)
        c = consumer(redis_db, f"c{n}")
        crashed = False
        while not crashed:
            keep, dead = c.claim_stale(10)
            dead_lettered += [e.id for e in dead]
            if not keep and not dead:
                break
            for e in keep:
                if e.id == poison:
                    crashed = True  # this worker dies too; the rest of what it claimed stays pending
                    break
                c.ack([e.ref])
                done.append(e.id)
        if not crashed and redis_db.xpending(S, G)["pending"] == 0:
            break
    assert dead_lettered == [poison]
    assert sorted(done) == sorted(i for i in ids if i != poison)


def test_a_dead_consumers_entries_are_found_behind_a_live_ones_backlog(redis_db: redis.Redis) -> None:
    """The oldest pending entries all a live worker's (a backlog of failing webhooks it retries): a dead worker's
    entry, newer, is still taken over (the listing was of the group's oldest entries, whoever held them: past
    a few hundred of a live worker's, a dead one's waited until those were gone)."""
    a, b, c = consumer(redis_db, "a"), consumer(redis_db, "b"), consumer(redis_db, "c")
    beat(redis_db, POOL, "a", "{}", 60_000)
    redis_db.xadd(S, {"job_id": "first"})
    for i in range(40):
        redis_db.xadd(S, {"job_id": f"backlog_{i}"})
    a.read(100, 100)  # a holds 41, alive
    eid = redis_db.xadd(S, {"job_id": "orphan"})
    assert [e.id for e in c.read(10, 100)] == [eid]  # c takes one, and dies
    idle(redis_db)
    keep, dead = b.claim_stale(count=5)
    assert [e.id for e in keep] == [eid] and not dead


def test_a_due_retry_is_found_behind_entries_not_yet_due(redis_db: redis.Redis) -> None:
    """A consumer's own failed entries, the oldest not due again for long (backed off): one due now, newer, is
    tried again now (only the first `count` were looked at: past them, a due retry waited for the oldest)."""
    a = consumer(redis_db, "a", limit=100)
    for i in range(30):
        redis_db.xadd(S, {"job_id": f"backed_off_{i}"})
    a.read(100, 100)
    eid = redis_db.xadd(S, {"job_id": "due"})
    a.read(10, 100)
    idle(redis_db)
    backed_off = {f"backed_off_{i}" for i in range(30)}
    # the backed-off ones were tried twice already (their retry failed: XCLAIM counts a delivery), the due one once
    redis_db.xclaim(S, G, "a", 0, [e for e, f in redis_db.xrange(S) if f["job_id"] in backed_off])
    keep, _ = a.retry_own(0, count=5, due_ms=lambda tries: 0 if tries == 1 else 3_600_000)
    assert [e.id for e in keep] == [eid]
