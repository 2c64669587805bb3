"""The key layout on a real Redis Cluster: every script's keys (and the channel it publishes on) hash
to one slot, as the live cluster computes it (CLUSTER KEYSLOT); jobs spread over every master; chunks
go out by sharded pub/sub."""

from __future__ import annotations

import httpx
import pytest

from harness.stack import Stack
from shared import fair_queue, job_ops, names
from shared.jobs import FinishReason
from tests.helpers import until, wait

# the cluster stack's partitions (`--redis-cluster 3` sets 4 per master), for the keys this process names inside
# `names.partitions_as`
STACK_PARTITIONS = 12


def _writes(job_id: str, owner: str) -> dict[str, tuple[list[str], list[object]]]:
    step = job_ops.step_write(job_id, job_ops.FRESH, 0, b"", 0, b"x", 1, b"{}", 1)
    return {
        "submit": job_ops.submit_write(job_id, {}, "{}", 60, owner=owner, idempotency_key="k1",
                                       idempotency_ttl_s=60),
        "start": job_ops.start_write(job_id, "w", 60),
        "step": job_ops.step_call(*step, 60),
        "finish": job_ops.finish_write(job_id, FinishReason.stop, "", 60),
        "request_cancel": job_ops.request_cancel_write(job_id),
        "account": job_ops.account_write(job_id, 60),
        "note_failure": job_ops.note_failure_write(job_id, "why"),
        "stream_open": job_ops.stream_open_write(owner or "t", "s1", 60, 5),
        "tail": job_ops.tail_write(names.stream(names.JOBS, names.job_partition(job_id)), 5),
        "count_after": job_ops.count_after_write(names.stream(names.TOKENIZED, names.job_partition(job_id)),
                                                 "0-0", 10, 10),
        "fair_push": fair_queue.push_write(names.job_partition(job_id), ["0-1"], [(job_id, 0, 3, b"row")]),
        "fair_pop": fair_queue.pop_write(names.job_partition(job_id), "w", 4),
    }


@pytest.mark.parametrize("partitions", [1, 12])
def test_every_script_touches_one_slot(cluster_stack: Stack, partitions: int) -> None:
    with names.partitions_as(partitions):
        every_script_touches_one_slot(cluster_stack)


def every_script_touches_one_slot(cluster_stack: Stack) -> None:
    r = cluster_stack.redis()
    for owner in ("", "acme", "tenant-7"):
        p = names.new_job_partition(owner, "k1")  # a job with an idempotency key goes where its key lives
        job_id = names.job_id_in(p, "ab" * 16)
        assert names.job_partition(job_id) == p
        for script, (keys, args) in _writes(job_id, owner).items():
            slots = {r.cluster_keyslot(k) for k in keys}
            # the channel a script publishes on is a key too for sharded pub/sub, and keys a script names from
            # a partition prefix it is given (a tenant's fair queue, its counters) are in that partition's slot
            slots |= {r.cluster_keyslot(a) for a in args if isinstance(a, str) and (
                ":chan:" in a or a.startswith(names.PREFIX + ":{p"))}
            assert len(slots) == 1, (script, owner, keys)


def test_jobs_spread_over_every_master_and_chunks_go_by_sharded_pubsub(cluster_stack: Stack) -> None:
    with names.partitions_as(STACK_PARTITIONS):
        jobs_spread_over_every_master_and_chunks_go_by_sharded_pubsub(cluster_stack)


def jobs_spread_over_every_master_and_chunks_go_by_sharded_pubsub(cluster_stack: Stack) -> None:
    r = cluster_stack.redis()
    masters = r.get_primaries()

    def published() -> dict[str, int]:
        return {m.name: int(m.redis_connection.info("commandstats").get("cmdstat_spublish", {}).get("calls", 0))
                for m in masters}

    before = published()
    with httpx.Client(base_url=cluster_stack.url, timeout=60) as client:
        def holders() -> set[str]:
            job = client.post("/v1/jobs", json={"prompt": "Spread", "max_tokens": 4, "temperature": 0}).json()
            assert wait(client, job["id"])["status"] == "succeeded"
            held.add(r.get_node_from_key(names.job_key(job["id"])).name)
            return held

        held: set[str] = set()
        until("jobs on every master", lambda: len(holders()) == len(masters), timeout=120)
    after = published()
    assert all(after[m.name] > before[m.name] for m in masters), (before, after)


async def test_tenant_limits_stay_exact_on_the_cluster(cluster_stack: Stack) -> None:
    """Admission is one atomic call in the tenant's partition: on a cluster a tenant's requests per
    minute and unfinished jobs are counted exactly, and a refusal stores nothing."""
    with names.partitions_as(STACK_PARTITIONS):
        await tenant_limits_stay_exact_on_the_cluster(cluster_stack)


async def tenant_limits_stay_exact_on_the_cluster(cluster_stack: Stack) -> None:
    from shared import tenants
    from shared.job_ops import AsyncJobOps
    from shared.jobs import new_record
    from shared.redis_client import async_client
    from shared.scripts.codes import SubmitCode

    r = cluster_stack.redis()
    tenants.create(r, "cluster-tenant", rpm=3, tpm=0, max_queued=0, max_streams=0)
    client = async_client(cluster_stack.redis_url)
    ops = AsyncJobOps(client, 60)
    codes = []
    cluster_stack.pause("tokenizer")  # the accepted jobs stay unfinished while we count them
    try:
        for i in range(5):
            job_id = names.job_id_in(names.new_job_partition("cluster-tenant"), f"{i + 1:x}" * 32)
            reply = await ops.submit(job_id, new_record(job_id, "m", "{}"), "{}", owner="cluster-tenant")
            codes.append(reply.code)
            if reply.code is not SubmitCode.accepted:
                assert not r.exists(names.job_key(job_id))  # a refusal stores nothing
        assert codes == [SubmitCode.accepted] * 3 + [SubmitCode.over_rpm] * 2
        assert r.get(names.tenant_active_key("cluster-tenant")) == "3"
    finally:
        cluster_stack.resume("tokenizer")
        await client.aclose()
