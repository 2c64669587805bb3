"""The scripts on a real Redis Cluster (3 masters), called as the stages call them: a cluster client sends each
call to the slot of its KEYS and refuses KEYS of several slots, so a job's whole life here shows every call's
keys in one slot; a queued job's cancel leaves the fair queue, and a finish names its owner's keys."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from infra.redis_cluster import LocalCluster
from shared import fair_queue, names, scripts
from shared.fair_queue import FairQueue
from shared.job_ops import FIRST_TOKEN, FRESH, JobOps, pack_ids, step_write, submit_write
from shared.jobs import FinishReason, new_record
from shared.redis_client import sync_client
from shared.scripts.codes import FinishCode, FinishReply, StartCode, StepCode, StepReply, SubmitCode, SubmitReply


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[redis.Redis]:
    nodes = LocalCluster(tmp_path_factory.mktemp("scripts-cluster"), masters=3, replicas=0, appendfsync="no")
    nodes.start()
    client = sync_client(nodes.seed_url, decode=False)
    yield client
    client.close()
    nodes.stop()


def _submit(r: redis.Redis, job_id: str, owner: str) -> None:
    record = {k: v for k, v in new_record(job_id, "m", "{}").items() if k != "request"}
    write = submit_write(job_id, record, "{}", 60, owner=owner, reserve_tokens=40)
    assert SubmitReply.parse(scripts.SUBMIT(r, *write)).code is SubmitCode.accepted


def test_a_job_runs_its_whole_life_on_a_cluster(cluster: redis.Redis) -> None:
    r, owner = cluster, "acme-cluster"
    p = names.tenant_partition(owner)
    r.hset(names.tenant_key(owner), mapping={"disabled": "0", "rpm": 0, "tpm": 100, "max_queued": 0})
    r.xgroup_create(names.stream(names.TOKENIZED, p), names.INFERENCE_GROUP, id="0", mkstream=True)
    ops, job_id = JobOps(r, 60), names.job_id_in(p, "a1" * 16)
    _submit(r, job_id, owner)
    assert fair_queue.push(r, p, [], [(job_id, 0, 10, b"row")]) == 1
    [entry] = FairQueue(r, "w").pop(4, None)
    assert entry.fields[b"batch"] == b"row"
    took = ops.start(job_id, "w")
    assert (took.code, took.owner) == (StartCode.started, owner)
    keys, args = step_write(job_id, FRESH | FIRST_TOKEN, 0, pack_ids([7]), 0, b"Hi", 1, b"{}", 1, worker="w")
    pipe = r.pipeline(transaction=False)
    ops.step(keys, args, pipe, {owner: (2.0, 1)})
    ops.finish(job_id, FinishReason.stop, fields={"completion_tokens": 1}, pipe=pipe, worker="w", owner=took.owner)
    step, end = pipe.execute()
    assert StepReply.parse(step).codes == (StepCode.written,) and FinishReply.parse(end) == FinishReply(
        FinishCode.finished, 2)
    assert r.get(names.text_key(job_id)) == b"Hi" and r.get(names.tenant_active_key(owner)) == b"0"
    assert float(r.hget(names.fair_key(p, "vtc"), owner)) == 12.0  # 10 prompt tokens, then 2 for the token


def test_a_queued_job_cancelled_on_a_cluster_leaves_the_fair_queue(cluster: redis.Redis) -> None:
    r, owner = cluster, "other-cluster"
    p = names.tenant_partition(owner)
    r.hset(names.tenant_key(owner), mapping={"disabled": "0", "rpm": 0, "tpm": 0, "max_queued": 0})
    ops, job_id = JobOps(r, 60), names.job_id_in(p, "b2" * 16)
    _submit(r, job_id, owner)
    assert fair_queue.push(r, p, [], [(job_id, 0, 10, b"row")]) == 1
    assert fair_queue.waiting_jobs(r, p, owner) == [job_id]
    got = ops.finish(job_id, FinishReason.cancelled, required_status="queued", owner="not-the-owner")
    assert got == FinishReply(FinishCode.finished, 1)  # refused as owner_changed, then named from the record
    assert fair_queue.waiting_jobs(r, p, owner) == [] and r.zscore(names.fair_key(p, "tenants"), owner) is None
    assert r.get(names.tenant_active_key(owner)) == b"0"
