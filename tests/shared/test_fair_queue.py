"""The fair queue's order, deterministically: jobs go through the real scripts (the tokenizer's push,
the inference worker's pop and start, the output lane's step with its charges) on a real Redis, and a loop stands in for
the engines: SLOTS jobs at a time, one token per job per step, jobs of different lengths. The service
each tenant got is counted here, from what was popped and generated, not read back from Redis.

Service is weighted as the scheduler weighs it: a prompt token 1, a generated token 2, over the tenant's
weight. The Virtual Token Counter's bound (Sheng et al., OSDI 2024): while two tenants stay backlogged
the service they got differs by at most twice the largest job's cost."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import redis

from shared import fair_queue, names
from shared.fair_queue import INPUT_COST, OUTPUT_COST, FairQueue
from shared.job_ops import FRESH, JobOps, step_write
from shared.jobs import FinishReason, new_record
from shared.redis_client import sync_client
from shared.schemas import TOKENIZED_SCHEMA, Request, encode_request, from_ipc
from shared.stream_consumer import Entry

SLOTS = 4
PROMPT, MAX_TOKENS = 10, 8
JOB_COST = PROMPT * INPUT_COST + MAX_TOKENS * OUTPUT_COST
BOUND = 2 * JOB_COST  # the paper's: twice the largest job's cost
OTHER = "other"  # a second model's queue (shared/served.py), in the same partition


@pytest.fixture
def raw(redis_server) -> Iterator[redis.Redis]:  # type: ignore[no-untyped-def]
    client = sync_client(redis_server.url.rsplit("/", 1)[0] + "/2", decode=False)
    client.flushdb()
    client.xgroup_create(names.stream(names.TOKENIZED, 0), names.INFERENCE_GROUP, id="0", mkstream=True)
    client.xgroup_create(names.stream(names.TOKENIZED, 0, OTHER), names.INFERENCE_GROUP, id="0", mkstream=True)
    client.xgroup_create(names.stream(names.JOBS, 0), names.TOKENIZER_GROUP, id="0", mkstream=True)
    yield client
    client.flushdb()
    client.close()


@dataclass
class Sim:
    """Submitted jobs, the fair queue, and SLOTS engine slots generating a token per job per step."""

    r: redis.Redis
    weights: dict[str, float]
    running: dict[str, int] = field(default_factory=dict)  # job id -> tokens generated
    owner: dict[str, str] = field(default_factory=dict)
    length: dict[str, int] = field(default_factory=dict)  # job id -> its max_tokens (they differ, 2..MAX_TOKENS)
    charged: dict[str, tuple[str, float]] = field(default_factory=dict)  # job id -> (tenant, weight) from start
    served: Counter[str] = field(default_factory=Counter)  # tenant -> weighted service (not over weight)
    started: list[str] = field(default_factory=list)
    n: int = 0
    busy: int = 0  # slots running in the last step
    model: str = ""  # the model queue its jobs wait in and its engine pops ('' the default model's)

    def __post_init__(self) -> None:
        self.queue = FairQueue(self.r, "engine-1", self.model)
        self.ops = JobOps(self.r, 3600, self.model)

    def submit(self, tenant: str, count: int, priority: int = 0) -> list[str]:
        """`count` jobs of `tenant`, stored as submit.lua stores them and pushed as the tokenizer pushes."""
        ids = []
        for _ in range(count):
            self.n += 1
            job_id = names.job_id_in(0, f"{self.model.encode().hex()[:10]}{self.n:020x}")
            rec = new_record(job_id, "m", "{}") | ({"base_model": self.model} if self.model else {})
            self.r.hset(names.job_key(job_id), mapping={**{k: v for k, v in rec.items() if k != "request"},
                                                       "owner": tenant, "weight": self.weights[tenant]})
            self.length[job_id] = 2 + self.n * 5 % (MAX_TOKENS - 1)
            row = encode_request(Request(job_id, [1] * PROMPT, max_tokens=self.length[job_id]))
            assert fair_queue.push(self.r, 0, [], [(job_id, priority, PROMPT, row)], model=self.model) == 1
            self.owner[job_id] = tenant
            ids.append(job_id)
        return ids

    def step(self) -> None:
        """Fill free slots from the fair queue, then one token for every running job."""
        free = SLOTS - len(self.running)
        if free:
            for entry in self.queue.pop(free, None):
                [req] = [row["id"] for row in from_ipc(entry.fields[b"batch"], TOKENIZED_SCHEMA).to_pylist()]
                self.r.xack(entry.stream, names.INFERENCE_GROUP, entry.id)
                took = self.ops.start(req, "engine-1")  # as admission does: the tenant its tokens are charged to
                assert (took.tenant, took.weight) == (self.owner[req], self.weights[self.owner[req]])
                self.charged[req] = (took.tenant, took.weight)
                self.running[req] = 0
                self.started.append(req)
                self.served[self.owner[req]] += PROMPT * INPUT_COST
        self.busy = len(self.running)
        keys: list[str] = []
        args: list[object] = []
        for job_id in list(self.running):
            self.running[job_id] += 1
            self.served[self.owner[job_id]] += OUTPUT_COST
            tenant, weight = self.charged[job_id]
            k, a = step_write(job_id, FRESH if self.running[job_id] == 1 else 0, 0, b"", 0, b"", 0, b"",
                              self.running[job_id], worker="engine-1", charge=(tenant, OUTPUT_COST / weight, 1))
            keys += k
            args += a
        if keys:
            pipe = self.r.pipeline(transaction=False)
            self.ops.step(keys, args, pipe)
            pipe.execute()
        for job_id, n in list(self.running.items()):
            if n >= self.length[job_id]:
                del self.running[job_id]

    def waiting(self, tenant: str) -> int:
        return len(fair_queue.waiting_jobs(self.r, 0, tenant, self.model))

    def gap(self, a: str, b: str) -> float:
        return abs(self.served[a] / self.weights[a] - self.served[b] / self.weights[b])


@pytest.mark.parametrize("model", ["", OTHER], ids=["default-model", "other-model"])
@pytest.mark.parametrize("weights", [{"a": 1.0, "b": 1.0}, {"a": 1.0, "b": 3.0}], ids=["1:1", "1:3"])
def test_backlogged_tenants_are_served_by_weight_within_the_bound(raw: redis.Redis, weights: dict[str, float],
                                                                  model: str) -> None:
    sim = Sim(raw, weights, model=model)
    sim.submit("a", 60)
    sim.submit("b", 60)
    worst = 0.0
    while sim.waiting("a") and sim.waiting("b"):
        sim.step()
        worst = max(worst, sim.gap("a", "b"))
    assert worst <= BOUND, (worst, BOUND)
    # and the weights show: b, three times a's weight, got about three times a's service meanwhile
    ratio = sim.served["b"] / sim.served["a"]
    assert weights["b"] * 0.8 <= ratio <= weights["b"] * 1.25, ratio


def test_a_tenant_back_from_idle_gets_no_burst(raw: redis.Redis) -> None:
    """While b was away a was served alone (its counter grew); b comes back with a backlog and is lifted
    to a's counter: from then on the two get equal service within the bound, b no more."""
    sim = Sim(raw, {"a": 1.0, "b": 1.0})
    sim.submit("a", 200)
    for _ in range(60):
        sim.step()
    assert sim.waiting("a")
    before = Counter(sim.served)
    sim.submit("b", 30)
    worst_b_ahead = 0.0
    while sim.waiting("a") and sim.waiting("b"):
        sim.step()
        since = {t: sim.served[t] - before[t] for t in ("a", "b")}
        worst_b_ahead = max(worst_b_ahead, since["b"] - since["a"])
    assert worst_b_ahead <= BOUND, worst_b_ahead
    assert sim.waiting("b") == 0  # and b was served all along: its backlog ended first


def test_a_tenant_alone_gets_every_slot(raw: redis.Redis) -> None:
    """Work-conserving: with one tenant backlogged, no slot stays empty while it has jobs waiting."""
    sim = Sim(raw, {"a": 1.0, "b": 1.0})
    sim.submit("a", 20)
    while sim.waiting("a"):
        sim.step()
        assert sim.busy == SLOTS
    assert len(sim.started) >= 20 - SLOTS


def test_lower_priority_value_runs_first_then_arrival(raw: redis.Redis) -> None:
    sim = Sim(raw, {"a": 1.0})
    later = sim.submit("a", 100, priority=1)
    urgent = sim.submit("a", 1, priority=0)
    first_of_the_rest = sim.submit("a", 1, priority=1)
    sim.step()
    assert sim.started[0] == urgent[0]
    assert sim.started[1:SLOTS] == later[:SLOTS - 1]  # ties go by arrival
    while sim.waiting("a"):
        sim.step()
    assert sim.started[-1] == first_of_the_rest[0] or first_of_the_rest[0] in sim.running


def test_a_job_ended_while_waiting_leaves_the_queue(raw: redis.Redis) -> None:
    """A job cancelled (or failed) while it waits is taken out of its tenant's queue by finish.lua; a
    tenant with nothing left waiting is no longer backlogged."""
    sim = Sim(raw, {"a": 1.0})
    [job_id] = sim.submit("a", 1)
    assert sim.ops.finish(job_id, FinishReason.cancelled) is not None
    assert sim.waiting("a") == 0 and not raw.zscore(names.fair_key(0, "tenants"), "a")
    assert not raw.hexists(names.fair_key(0, "payload"), job_id)
    assert sim.queue.pop(4, None) == []


def test_each_model_has_its_own_queue(raw: redis.Redis) -> None:
    """Two models' jobs in one partition: each model's engines take only its own, in its own fair order, and a
    job of the second model ended while it waits (finish reads its record's model) leaves that model's queue."""
    first, second = Sim(raw, {"a": 1.0, "b": 1.0}), Sim(raw, {"a": 1.0, "b": 1.0}, model=OTHER)
    mine, theirs = first.submit("a", 3), second.submit("a", 2) + second.submit("b", 2)
    assert names.fair_key(0, "queue", OTHER).startswith("conveyor:{p0}:")  # the partition's slot, its own keys
    assert first.waiting("a") == 3 and second.waiting("a") == 2 and second.waiting("b") == 2
    assert second.ops.finish(theirs[0], FinishReason.cancelled) is not None
    assert JobOps(raw, 3600).finish(theirs[1], FinishReason.cancelled) is not None  # any process: the record names it
    assert second.waiting("a") == 0 and first.waiting("a") == 3
    assert not raw.zscore(names.fair_key(0, "tenants", OTHER), "a")
    taken = [e.fields[b"batch"] for e in second.queue.pop(8, None)]
    assert [row["id"] for b in taken for row in from_ipc(b, TOKENIZED_SCHEMA).to_pylist()] == theirs[2:]
    assert {e.stream for e in first.queue.pop(8, None)} == {names.stream(names.TOKENIZED, 0)}
    assert first.waiting("a") == 0 and mine


def test_a_push_sent_twice_queues_once(raw: redis.Redis) -> None:
    """The tokenizer's push replayed (its reply lost to an outage) queues nothing twice, and a job popped
    meanwhile is not queued again."""
    sim = Sim(raw, {"a": 1.0})
    [job_id] = sim.submit("a", 1)
    row = raw.hget(names.fair_key(0, "payload"), job_id)
    assert fair_queue.push(raw, 0, [], [(job_id, 0, PROMPT, row)]) == 0
    assert sim.waiting("a") == 1
    sim.step()
    assert fair_queue.push(raw, 0, [], [(job_id, 0, PROMPT, row)]) == 0
    assert sim.waiting("a") == 0 and sim.started == [job_id]


def test_the_tenants_shown_are_bounded_and_the_rest_summed(raw: redis.Redis) -> None:
    """/metrics, the dashboard and `conveyor status` read `read_tenants`: the tenants with the most waiting by
    name, the rest as one `_other` row, so label cardinality stays bounded whatever the tenant count."""
    weights = {f"t{i:02d}": 1.0 for i in range(12)}
    sim = Sim(raw, weights)
    for i, tenant in enumerate(weights):
        sim.submit(tenant, i + 1)  # t11 has the most waiting
    sim.step()  # SLOTS jobs taken: their prompts are served
    rows = fair_queue.read_tenants(raw, top=10)
    assert [r.tenant for r in rows[:10]] == [f"t{i:02d}" for i in range(11, 1, -1)]
    other = rows[10]
    assert other.tenant == fair_queue.OTHERS and len(rows) == 11
    assert sum(r.waiting for r in rows) == sum(range(1, 13)) - SLOTS
    assert sum(r.served_tokens for r in rows) == SLOTS * PROMPT + SLOTS  # the prompts, and a token each
    assert all(r.oldest_wait_s >= 0 for r in rows) and rows[0].oldest_wait_s > 0
    shares = fair_queue.tenant_rows(rows)
    assert abs(sum(r["share"] for r in shares) - 1) < 1e-9


def _ids(entries: list[Entry]) -> list[str]:
    return [i for e in entries for i in from_ipc(e.fields[b"batch"], TOKENIZED_SCHEMA).column("id").to_pylist()]


def test_a_full_worker_takes_only_what_its_engine_makes_room_for(raw: redis.Redis) -> None:
    """An inference worker with every slot taken names each tenant it holds with the worst priority it holds
    of it: it takes a job of another tenant, or a held tenant's job of a strictly better priority (its engine
    gives that one the slot of the worse), or nothing."""
    sim = Sim(raw, {"heavy": 1.0, "light": 1.0})
    sim.submit("heavy", 5, priority=1000)  # a batch's lines
    assert sim.queue.pop(1, None, skip={"heavy": 1000}) == []  # the batch's lines run there: an equal one waits
    assert sim.queue.pop(1, None, skip={"heavy": 0}) == []  # so does a worse one
    [light] = sim.submit("light", 1, priority=1000)
    assert _ids(sim.queue.pop(1, None, skip={"heavy": 1000})) == [light]  # a tenant with nothing there
    [urgent] = sim.submit("heavy", 1, priority=0)  # an interactive request of the batch's tenant
    assert sim.queue.pop(1, None, skip={"heavy": 0}) == []
    assert _ids(sim.queue.pop(1, None, skip={"heavy": 1000})) == [urgent]
    [negative] = sim.submit("heavy", 1, priority=-3)  # scores below zero: the priority is still read exactly
    assert sim.queue.pop(1, None, skip={"heavy": -3}) == []
    assert _ids(sim.queue.pop(1, None, skip={"heavy": -2})) == [negative]
    assert sim.waiting("heavy") == 5 and sim.waiting("light") == 0


def test_fair_share_off_is_one_queue_in_arrival_order(raw: redis.Redis) -> None:
    """FAIR_SHARE=false: every tenant's jobs in one queue, first in, first out (by priority)."""
    sim = Sim(raw, {"heavy": 1.0, "light": 1.0})
    ids = []
    for tenant in ("heavy", "heavy", "light", "heavy", "light"):
        sim.n += 1
        job_id = names.job_id_in(0, f"{sim.n:030x}")
        raw.hset(names.job_key(job_id), mapping={**{k: v for k, v in new_record(job_id, "m", "{}").items()
                                                    if k != "request"}, "owner": tenant})
        row = encode_request(Request(job_id, [1] * PROMPT, max_tokens=2))
        assert fair_queue.push(raw, 0, [], [(job_id, 0, PROMPT, row)], by_tenant=False) == 1
        ids.append(job_id)
    assert sim.waiting(names.ANONYMOUS_TENANT) == 5 and not sim.waiting("light")
    taken = sim.queue.pop(5, None)
    assert [from_ipc(e.fields[b"batch"], TOKENIZED_SCHEMA).column("id")[0].as_py() for e in taken] == ids
