"""No 202 without its copy, on a real Redis Cluster: a submit whose write no replica confirms in time
answers a retryable 503, and the client's retry with the same Idempotency-Key, once the replica is back,
finds the same job and runs it once."""

from __future__ import annotations

import uuid

import httpx
import psutil

from harness.stack import Stack
from shared import names
from tests.helpers import until, wait

STACK_PARTITIONS = 12  # the cluster stack's (`--redis-cluster 3`), for the keys this thread names


def _replica_of(stack: Stack, key: str) -> psutil.Process:
    """The redis-server process of the replica of the master that holds `key`."""
    r = stack.redis()
    try:
        master = r.get_node_from_key(key)  # type: ignore[attr-defined]
        view = r.cluster_nodes()  # type: ignore[attr-defined]
    finally:
        r.close()
    master_id = next(n["node_id"] for addr, n in view.items() if addr.split("@")[0] == master.name)
    port = next(int(addr.split("@")[0].rsplit(":", 1)[1]) for addr, n in view.items()
                if "slave" in n["flags"] and n["master_id"] == master_id)
    for _, proc in stack.tree():
        try:
            if any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in proc.net_connections("tcp")):
                return proc
        except psutil.Error:
            continue
    raise AssertionError(f"no process listens on the replica's port {port}")


def test_a_submit_no_replica_confirms_is_a_503_and_its_retry_finds_the_same_job(cluster_stack: Stack) -> None:
    key = f"copy-{uuid.uuid4().hex}"
    body = {"prompt": "Copies", "max_tokens": 4, "temperature": 0}
    with names.partitions_as(STACK_PARTITIONS):
        partition = names.new_job_partition("", key)  # a job with an idempotency key and no tenant goes there
        replica = _replica_of(cluster_stack, names.stream(names.JOBS, partition))
        idem = names.idempotency_key("", key)
    with httpx.Client(base_url=cluster_stack.url, timeout=30) as client:
        replica.suspend()  # it stops acknowledging its master's writes
        try:
            refused = client.post("/v1/jobs", json=body, headers={"Idempotency-Key": key})
        finally:
            replica.resume()
        assert refused.status_code == 503, refused.text
        assert refused.headers["Retry-After"]
        assert "no replica confirmed" in refused.json()["error"]["message"]

        def retried() -> httpx.Response | None:
            r = client.post("/v1/jobs", json=body, headers={"Idempotency-Key": key})
            return r if r.status_code != 503 else None

        accepted = until("the retry to be acknowledged", retried, timeout=60, every=0.2)
        assert accepted.status_code == 202, accepted.text
        job_id = accepted.json()["id"]
        r = cluster_stack.redis()
        try:
            assert str(r.get(idem)).split(":")[0] == job_id  # the job the first try left: the only one for the key
        finally:
            r.close()
        assert wait(client, job_id)["status"] == "succeeded"
