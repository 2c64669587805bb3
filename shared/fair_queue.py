"""The fair queue: where tokenized jobs wait for an inference worker, one queue per tenant, served by
the Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024).

Each partition (shared/names.py) keeps, in its own slot and a fixed set of keys (so every script names each
key it touches up front, whichever tenant it picks):
- every waiting job in one sorted set of equal scores, members `<tenant>:<order>:<job id>` in lexical order:
  a tenant's members together, by priority (lower first), then arrival; and the same by submit time, for
  the oldest wait; and each waiting job's place in both (fair_push.lua names them);
- the backlogged tenants, a sorted set scored by each one's virtual counter;
- the counters: a tenant is charged INPUT_COST per prompt token when its job is taken and OUTPUT_COST
  per generated token as the output lane records them (step.lua), each over the tenant's weight
  (`conveyor keys create --weight`, 1 by default; a job records its tenant's weight at submit);
- the waiting jobs' tokenized rows, a doorbell, and the tokens served per tenant (for the share shown).

A tokenizer queues its jobs with `push` (fair_push.lua, which also acknowledges their `jobs` entries).
An inference worker with free slots calls `FairQueue.pop`: fair_pop.lua takes the next job from the
backlogged tenant with the smallest counter, as many times as asked, appends each to the partition's
`tokenized` stream and reads them there as this consumer in the same call, so a job taken is pending
on the stream, claimed and redelivered like any entry (shared/stream_consumer.py) if its worker dies.
A tenant that becomes backlogged starts at the smallest counter of the backlogged tenants: idle time
banks no credit. Since every worker pops from the same sorted set, the order holds service-wide, not
per worker. The bound (the paper's): while two tenants stay backlogged, the weighted service each
received differs by at most twice the largest job's cost (INPUT_COST x its prompt + OUTPUT_COST x its
max_tokens, over the weight); tests/shared/test_fair_queue.py checks it at every step. Without keys
every job is one tenant (`names.ANONYMOUS_TENANT`): first in, first out by priority, as before;
FAIR_SHARE=false queues every tenant's jobs so too.

Which job an engine takes is half of it; a slot is the other. An inference worker takes only what its
engine can start soon (gpu_worker/reader.py). With every slot taken it still takes the jobs its engine makes
room for (`pop(skip=...)`: each tenant it holds, with the worst priority it holds of that tenant): a job of
a tenant that has none there, or one of a strictly better priority than the worst its tenant has there (an
interactive request beside its own batch's lines). The engine (gpu_worker/engine/scheduler.py) gives the
first the slot of the tenant running the most, the second the slot of its tenant's job of the worst
priority, unless a slot frees within 16 steps anyway: such a job waits at most that, not for a running
job's whole run.

With several partitions each is fair on its own: a tenant lives in one partition (its jobs and limits
do), so fairness holds among the tenants of a partition, and partitions are served in turn.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from shared import names, scripts
from shared.masters import Masters
from shared.redis_client import CLUSTER_TYPES, RETRYABLE, text
from shared.ring import Ring
from shared.stream_consumer import Entry

INPUT_COST = 1  # per prompt token (fair_pop.lua)
OUTPUT_COST = 2  # per generated token (step.lua)
STREAM_CAP = 100_000  # the `tokenized` stream's approximate length cap: entries live there only while running
TOP_TENANTS = 10  # tenants shown by name in /metrics, the dashboard and `conveyor status`; the rest summed
OTHERS = "_other"  # the row of the rest (no tenant name starts with '_')

Write = tuple[list[str], list[Any]]


WAITING = ("queue", "age", "waiting")  # the fair_key parts of the waiting jobs (fair_push.lua's KEYS 7-9)


def push_write(partition: int, ack_ids: list[str], jobs: list[tuple[str, int, int, bytes]],
               by_tenant: bool = True, ttl_s: int = 0, model: str = "") -> Write:
    """A fair_push call: `jobs` are (job id, priority, prompt tokens, one-row tokenized batch); `ack_ids`
    the partition's `jobs` entries they came from. `by_tenant` False (FAIR_SHARE=false): one queue. `ttl_s`
    (JOB_TTL_S; 0 leaves it): each queued job's record counts its TTL afresh. `model`: the queue of the model
    the jobs run on ('' the default's: shared/served.py)."""
    keys = [names.fair_key(partition, part, model) for part in ("tenants", "vtc", "payload", "arrivals", "bell")]
    keys += [names.stream(names.JOBS, partition), *(names.fair_key(partition, part, model) for part in WAITING),
             names.ring_key(partition, names.INFERENCE_GROUP, model)]
    args: list[Any] = [names.TOKENIZER_GROUP, int(by_tenant), ttl_s, len(ack_ids), *ack_ids]
    for job in jobs:
        keys.append(names.job_key(job[0]))
        args += job
    return keys, args


def pop_write(partition: int, consumer: str, count: int, skip: Mapping[str, int] | None = None,
              model: str = "") -> Write:
    """A fair_pop call: up to `count` jobs of `model`'s queue for `consumer`, as `tokenized` entries; a tenant in
    `skip` is passed over unless its next job's priority is lower than the one given (PRIORITY_MIN: always)."""
    keys = [names.fair_key(partition, part, model) for part in ("tenants", "vtc", "payload", "bell")]
    keys += [names.stream(names.TOKENIZED, partition, model), names.fair_key(partition, "served_by", model),
             *(names.fair_key(partition, part, model) for part in WAITING),
             names.ring_key(partition, names.INFERENCE_GROUP, model)]
    below = [x for tenant, priority in sorted((skip or {}).items()) for x in (tenant, priority)]
    return keys, [names.INFERENCE_GROUP, consumer, count, STREAM_CAP, *below]


def pop(client: redis.Redis | Any, partition: int, consumer: str, count: int,
        skip: Mapping[str, int] | None = None, model: str = "") -> list[Entry]:
    """One fair_pop call on one partition: its entries (see `pop_write`)."""
    return parse_entries(scripts.FAIR_POP(client, *pop_write(partition, consumer, count, skip, model)))


def push(client: redis.Redis | Any, partition: int, ack_ids: list[str], jobs: list[tuple[str, int, int, bytes]],
         by_tenant: bool = True, ttl_s: int = 0, model: str = "") -> int:
    """Queue tokenized jobs on `model`'s queue and acknowledge their `jobs` entries, in one atomic call;
    replaying it (a reply lost to an outage) queues nothing twice. Returns how many were queued."""
    return int(scripts.FAIR_PUSH(client, *push_write(partition, ack_ids, jobs, by_tenant, ttl_s, model)))


def parse_entries(reply: Any) -> list[Entry]:
    """fair_pop.lua's reply (XREADGROUP's, through Lua: fields as a flat list) as entries."""
    out = []
    for stream, items in reply or []:
        for eid, flat in items:
            if flat:
                out.append(Entry(text(eid), dict(zip(flat[::2], flat[1::2])), 1, text(stream)))
    return out


class FairQueue:
    """An inference worker's side: the next jobs of its model's queue, fairest first, from every partition."""

    def __init__(self, client: redis.Redis, consumer: str, model: str = "", masters: Masters | None = None) -> None:
        self.client, self.consumer, self.model = client, consumer, model
        self.cluster = isinstance(client, CLUSTER_TYPES)
        # a cluster's masters, which pops and ring flags go to one by one (shared/masters.py): on its fail-fast
        # client, where given (a consumer's: `StreamConsumer.masters`)
        self.masters = masters or Masters(client)
        self._turn = 0
        self._partition = {names.ring_key(p, names.INFERENCE_GROUP, model): p for p in names.partitions()}
        self.ring = Ring(client, list(self._partition), names.ring_channel(names.INFERENCE_GROUP, model))

    def pop(self, count: int, block_ms: int | None, skip: Mapping[str, int] | None = None) -> list[Entry]:
        """Up to `count` jobs, as entries of the `tokenized` streams (pending for this consumer); a tenant in
        `skip` only for a job of a priority lower than the one given. When none waits, waits up to `block_ms`
        for a doorbell (every partition's, in one BLPOP; on a cluster, the ring: shared/ring.py) and tries once
        more."""
        entries = self._pop_all(count, skip)
        if entries or not block_ms:
            return entries
        bells = [names.fair_key(p, "bell", self.model) for p in names.partitions()]
        if not self.cluster or len(bells) == 1:
            rung = self.client.blpop(bells, timeout=block_ms / 1000)
            return self._pop_all(count, skip) if rung else []
        if self.ring.listen() and (arm := self.ring.to_arm()):
            armed: list[str] = []
            for node, keys in self.masters.groups(arm, key=lambda k: k):  # (a master down: its flags wait)

                def flags(pipe: Any, keys: list[str] = keys) -> None:
                    for k in keys:
                        self.ring.arm(pipe, k)
                replies = self.masters.send(node, flags)
                if replies is not None:  # (a flag not set is set again next time: `to_arm`)
                    armed += [k for k, reply in zip(keys, replies) if not isinstance(reply, Exception)]
            entries = self._pop_each([self._partition[key] for key in armed], count, skip)  # what came before each
            if entries:
                return entries
        return self._pop_all(count, skip) if self.ring.wait(block_ms / 1000) else []

    def _pop_all(self, count: int, skip: Mapping[str, int] | None) -> list[Entry]:
        """One pop per partition, starting at the next in turn, until `count` are taken."""
        parts = names.partition_count()
        self._turn = (self._turn + 1) % parts
        return self._pop_each([(self._turn + i) % parts for i in range(parts)], count, skip)

    def _pop_each(self, partitions: list[int], count: int, skip: Mapping[str, int] | None) -> list[Entry]:
        """One pop per partition, in order, until `count` are taken. A partition whose master cannot take the pop
        (down, failing over, refusing writes: a cluster's) is passed over, and those of a master that does not answer
        for a moment (shared/masters.py): the jobs taken from the others are answered (they are this consumer's
        now; raising would strand them until they idle out), and its error is raised only when no partition
        answered."""
        entries: list[Entry] = []
        error: Exception | None = None
        answered = False
        failed: set[str] = set()  # (a cluster's) masters that failed a pop of this call: their other partitions wait
        client = self.masters.client if self.cluster else self.client
        for p in partitions:
            if len(entries) >= count:
                break
            key = names.fair_key(p, "tenants", self.model)
            node = self.masters.node(key)
            if node is not None and (node.name in failed or self.masters.is_down(key)):
                continue
            try:
                entries += pop(client, p, self.consumer, count - len(entries), skip, self.model)
            except RETRYABLE as exc:
                error = error or exc
                if node is not None:
                    failed.add(node.name)
                self.masters.fail(node, exc)
                continue
            answered = True
            self.masters.answered(node)
        if error is not None and not answered:  # (the slot map was read again: `Masters.fail`)
            raise error
        return entries


@dataclass(frozen=True)
class TenantLoad:
    """One tenant's place in the fair queue, summed over the partitions: jobs waiting, how long the
    oldest of them has waited, and the tokens (prompt + generated) served to it since the counts began."""

    tenant: str
    waiting: int = 0
    oldest_wait_s: float = 0.0
    served_tokens: int = 0


def read_tenants(client: redis.Redis, top: int = TOP_TENANTS, models: Sequence[str] = ("",)) -> list[TenantLoad]:
    """The `top` tenants with the most jobs waiting (then the most served), over the queues of `models`, and
    the rest summed as one OTHERS row when there are any: label cardinality stays bounded. Two round trips, and
    work in the tenants waiting and `top`, not in every tenant ever served (each queue's `served_by` is read by its
    top and its sum). `ANONYMOUS_TENANT` is the jobs without a key."""
    now = time.time()
    queues = [(p, m) for m in models for p in names.partitions()]
    pipe = client.pipeline(transaction=False)
    for p, m in queues:
        pipe.zrange(names.fair_key(p, "tenants", m), 0, -1)
        pipe.zrevrange(names.fair_key(p, "served_by", m), 0, top, withscores=True)  # (the sum first, then the top)
    first = pipe.execute()
    served: dict[str, int] = defaultdict(int)
    total = 0
    backlogged: list[tuple[tuple[int, str], str]] = []
    read: set[tuple[tuple[int, str], str]] = set()  # (queue, tenant) whose served tokens the top gave
    for q, (tenants, counts) in zip(queues, zip(first[::2], first[1::2])):
        backlogged += [(q, text(t)) for t in tenants]
        for t, n in counts:
            if text(t) == names.SERVED_TOTAL:
                total += int(n)
            else:
                served[text(t)] += int(n)
                read.add((q, text(t)))
    pipe = client.pipeline(transaction=False)
    for (p, m), t in backlogged:
        pipe.zlexcount(names.fair_key(p, "queue", m), *tenant_range(t))
        pipe.zrangebylex(names.fair_key(p, "age", m), *tenant_range(t), start=0, num=1)
        pipe.zscore(names.fair_key(p, "served_by", m), t)
    second = pipe.execute() if backlogged else []
    waiting: dict[str, int] = defaultdict(int)
    oldest: dict[str, float] = defaultdict(float)
    for (q, t), n, head, score in zip(backlogged, second[::3], second[1::3], second[2::3]):
        waiting[t] += int(n)
        if head:  # '<tenant>:<submitted at, ms>:<job id>'
            oldest[t] = max(oldest[t], now - int(text(head[0]).split(":")[1]) / 1000)
        if score is not None and (q, t) not in read:
            served[t] += int(score)
    rows = sorted((TenantLoad(t, waiting[t], round(oldest[t], 3), served[t]) for t in set(served) | set(waiting)),
                  key=lambda r: (-r.waiting, -r.served_tokens, r.tenant))
    rest = rows[top:]
    named = rows[:top]
    others = max(0, total - sum(r.served_tokens for r in named))  # every tenant not named, read or not
    if rest or others:
        rows = named + [TenantLoad(OTHERS, sum(r.waiting for r in rest), max((r.oldest_wait_s for r in rest),
                                                                             default=0.0), others)]
    return rows


def tenant_range(tenant: str) -> tuple[str, str]:
    """The lexical range of a tenant's members in the waiting jobs' sets (`<tenant>:...`; names hold no ':')."""
    return f"[{tenant}:", f"({tenant};"


def waiting_jobs(client: redis.Redis | Any, partition: int, tenant: str, model: str = "") -> list[str]:
    """A tenant's waiting job ids in a partition's queue of `model`, next first."""
    members = client.zrangebylex(names.fair_key(partition, "queue", model), *tenant_range(tenant))
    return [text(m).rsplit(":", 1)[1] for m in members]


def tenant_rows(rows: list[TenantLoad]) -> list[dict[str, Any]]:
    """`read_tenants` rows as the dashboard and `conveyor status` show them, with each tenant's share of
    the tokens served."""
    total = sum(r.served_tokens for r in rows) or 1
    return [{"tenant": r.tenant, "waiting": r.waiting, "oldest_wait_s": r.oldest_wait_s,
             "served_tokens": r.served_tokens, "share": r.served_tokens / total} for r in rows]
