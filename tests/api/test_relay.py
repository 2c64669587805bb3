"""The SSE relay, on the tiny-model stack (one Redis node, and a Redis Cluster): one shared pub/sub
connection (per node), resume at random cut points, slow clients."""

from __future__ import annotations

import contextlib
import json
import random
import threading

import httpx
import psutil
import pytest

from tests.helpers import iter_sse, read_events, submit, tokens_text, until, wait


@pytest.fixture
def client(plumbing_stack) -> httpx.Client:  # type: ignore[no-untyped-def]
    with httpx.Client(base_url=plumbing_stack.url, timeout=60) as c:
        yield c


def _subscribers(stack) -> list[int]:  # type: ignore[no-untyped-def]
    """Channel counts of the stack's API's connections subscribed to anything (`sub`, or `ssub` for sharded
    channels, in CLIENT LIST), over every node of a cluster: stacks running beside share the session's Redis, and the
    stack's idle workers subscribe to their rings (shared/ring.py) as they sleep and wake, whenever they do."""
    r = stack.redis()
    nodes = [n.redis_connection for n in r.get_nodes()] if hasattr(r, "get_nodes") else [r]
    ours = set()
    for proc in stack.by_role("api"):
        with contextlib.suppress(psutil.Error):
            ours |= {f"{c.laddr.ip}:{c.laddr.port}" for c in proc.net_connections("tcp") if c.raddr}
    counts = [int(c.get("sub", 0)) + int(c.get("ssub", 0)) for node in nodes for c in node.client_list()
              if c["addr"] in ours]
    return [n for n in counts if n > 0]


def _masters(stack) -> int:  # type: ignore[no-untyped-def]
    r = stack.redis()
    return len(r.get_primaries()) if hasattr(r, "get_primaries") else 1


def test_many_streams_share_one_pubsub_connection(plumbing_stack, client: httpx.Client) -> None:  # type: ignore[no-untyped-def]
    base = len(_subscribers(plumbing_stack))
    # the jobs stay queued (nothing leaves the queue while the tokenizer is stopped): their streams open and wait
    # on their channels, and no flood of tokens competes with the count
    plumbing_stack.pause("tokenizer")
    jobs = [submit(client, prompt=f"Story {i}:", max_tokens=1000, ignore_eos=True) for i in range(40)]
    stop = threading.Event()
    opened = threading.Semaphore(0)

    def hold(job_id: str) -> None:
        with httpx.Client(base_url=plumbing_stack.url, timeout=60) as c, \
                c.stream("GET", f"/v1/jobs/{job_id}/events") as r:
            opened.release()
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    threads = [threading.Thread(target=hold, args=(j["id"],), daemon=True) for j in jobs]
    for t in threads:
        t.start()
    try:
        for _ in jobs:
            assert opened.acquire(timeout=30)
        subs = until("the relay's connections to carry all 40 job channels",
                     lambda: (subs := _subscribers(plumbing_stack)) and sum(subs) >= 40 and subs, timeout=30)
        # one connection per node that owns channels (the job's partitions spread over a cluster's
        # masters), never one per stream
        assert len(subs) <= base + _masters(plumbing_stack)
    finally:
        stop.set()
        for j in jobs:
            client.post(f"/v1/jobs/{j['id']}/cancel")
        plumbing_stack.resume("tokenizer")


def test_resume_at_random_cut_points(client: httpx.Client) -> None:
    rng = random.Random(7)
    for _ in range(6):
        job = submit(client, messages=[{"role": "user", "content": "Describe a forest."}], temperature=0,
                     max_tokens=50)
        got: list[dict[str, str]] = []
        while not got or got[-1]["event"] != "done":
            last = got[-1]["id"] if got else None
            got += read_events(client, job["id"], headers={"Last-Event-ID": last} if last else None,
                               limit=rng.randint(1, 8))
        seqs = [int(e["id"]) for e in got]
        assert seqs == list(range(1, len(seqs) + 1))
        assert tokens_text(got) == wait(client, job["id"])["text"] == json.loads(got[-1]["data"])["text"]


def test_stalled_client_does_not_block_others(plumbing_stack, client: httpx.Client) -> None:  # type: ignore[no-untyped-def]
    slow_job = submit(client, prompt="Slow:", max_tokens=200, ignore_eos=True, temperature=0)
    # open a stream and never read it: its queue fills and it falls back to replay later
    stalled = httpx.Client(base_url=plumbing_stack.url, timeout=120)
    cm = stalled.stream("GET", f"/v1/jobs/{slow_job['id']}/events")
    cm.__enter__()
    try:
        fast = submit(client, messages=[{"role": "user", "content": "Say hi."}], temperature=0, max_tokens=20)
        events = read_events(client, fast["id"])
        assert events[-1]["event"] == "done"
        final = wait(client, slow_job["id"], timeout=600)
    finally:
        cm.__exit__(None, None, None)
        stalled.close()
    replay = read_events(client, slow_job["id"])
    assert tokens_text(replay) == final["text"]


def test_status_events_report_queue_position(plumbing_stack, client: httpx.Client) -> None:  # type: ignore[no-untyped-def]
    plumbing_stack.pause("tokenizer")  # nothing leaves the queue while we look
    ids: list[str] = []
    try:
        ids += [submit(client, prompt="Fill:", max_tokens=300, ignore_eos=True)["id"] for _ in range(3)]
        job = submit(client, prompt="Me next", max_tokens=5)
        ids.append(job["id"])
        assert job["status"] == "queued" and job["queue_position"] >= 1
        polled = client.get(f"/v1/jobs/{job['id']}").json()
        assert polled["status"] == "queued" and polled["queue_position"] >= 1
        with client.stream("GET", f"/v1/jobs/{job['id']}/events") as r:
            first = next(iter_sse(r))
        assert first["event"] == "status"
        data = json.loads(first["data"])
        assert data["status"] == "queued" and data["queue_position"] >= 1
    finally:
        for job_id in ids:
            client.post(f"/v1/jobs/{job_id}/cancel")
        plumbing_stack.resume("tokenizer")
    assert wait(client, job["id"])["status"] == "cancelled"


