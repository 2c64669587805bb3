"""Failover chaos: kill -9 of a Redis Cluster master under load, many rounds in a row on one stack.

    .venv/bin/python -m bench.failover                      # 20 rounds, 30 greedy jobs each, default model
    .venv/bin/python -m bench.failover --rounds 3 --tiny    # a short one on a tiny random model

Starts `conveyor up --redis-cluster 3` with REDIS_PARTITIONS=12 (the README's cluster settings: keys on every
master, Celery's broker on its own node) and fast redelivery. Each round submits --jobs greedy jobs (each
with an Idempotency-Key; a 503 is retried with the same key), and right after the last 202 kills -9 one
master: in even rounds one that is not the node REDIS_URL names first, in odd rounds that seed node itself
(when it is a master); a third as many jobs again are submitted through the failover. The supervisor
starts the dead node again, as a replica. A round passes when every accepted job ends succeeded with the
text of a clean run and an event stream of seqs 1..n that joins to it; a round in which some job has not
ended 180 s after the kill is a stall. The cluster is healthy again (every master with a replica) before
the next round. Exit status 1 if any round failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.common import PROMPTS, default_model, make_tiny_model, md_table
from harness.sse import check_events, read_events
from harness.stack import Stack, start_stack, stop_stack
from shared.jobs import TERMINAL
from shared.redis_client import seeds

ENV = {"CLAIM_IDLE_MS": "3000", "REFRESH_S": "0.5", "HEARTBEAT_S": "1", "LOG_LEVEL": "WARNING",
       "REDIS_PARTITIONS": "12", "DTYPE": "float32"}  # float32: greedy texts compare exactly across batches
DRAIN_S = 180.0


def body(i: int, max_tokens: int) -> dict[str, Any]:
    return {"prompt": PROMPTS[i % 5], "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}


def submit(client: httpx.Client, payload: dict[str, Any], counts: dict[str, int]) -> str | None:
    """The job's id once answered 202, retried with the same Idempotency-Key through 503s and resets."""
    key = uuid.uuid4().hex
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            r = client.post("/v1/jobs", json=payload, headers={"Idempotency-Key": key})
        except httpx.TransportError:
            counts["transport"] += 1
        else:
            if r.status_code == 202:
                return str(r.json()["id"])
            if r.status_code != 503:
                raise RuntimeError(f"submit answered {r.status_code}: {r.text[:300]}")
            counts["503"] += 1
        time.sleep(0.3)
    return None


def masters(stack: Stack) -> list[int]:
    """The ports of the cluster's live masters, as a live node sees them."""
    r = stack.redis()
    try:
        nodes = r.cluster_nodes()  # type: ignore[attr-defined]
    finally:
        r.close()
    return sorted(int(addr.split(":")[1].split("@")[0]) for addr, n in nodes.items()
                  if "master" in n["flags"] and "fail" not in n["flags"] and n["connected"])


def healthy(stack: Stack, nodes: int) -> bool:
    """Every node up and every master with a connected replica."""
    try:
        r = stack.redis()
        try:
            view = r.cluster_nodes()  # type: ignore[attr-defined]
        finally:
            r.close()
    except Exception:  # noqa: BLE001 - not yet
        return False
    up = [n for n in view.values() if n["connected"] and "fail" not in n["flags"]]
    primaries = {n["node_id"] for n in up if "master" in n["flags"]}
    served = {n["master_id"] for n in up if "slave" in n["flags"]}
    return len(up) == nodes and len(primaries) == 3 and primaries <= served


def pid_on(stack: Stack, port: int) -> int:
    for _, p in stack.tree():
        try:
            if any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in p.net_connections("tcp")):
                return p.pid
        except psutil.Error:
            continue
    raise RuntimeError(f"no process listens on {port}")


def one_round(stack: Stack, rnd: int, args: argparse.Namespace, clean: dict[int, str]) -> dict[str, Any]:
    counts = {"503": 0, "transport": 0}
    seed = int(seeds(stack.redis_url)[0].rsplit(":", 1)[1].split("/")[0])
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        accepted = {}
        for i in range(args.jobs):
            job_id = submit(client, body(i, args.max_tokens), counts)
            if job_id:
                accepted[job_id] = i
        live = masters(stack)
        target = seed if rnd % 2 == 1 and seed in live else next(p for p in live if p != seed)
        psutil.Process(pid_on(stack, target)).kill()
        killed_at = time.monotonic()
        for i in range(args.jobs, args.jobs + args.jobs // 3):  # and more through the failover: 503s, then 202s
            job_id = submit(client, body(i, args.max_tokens), counts)
            if job_id:
                accepted[job_id] = i
        ended: dict[str, dict[str, Any]] = {}
        while len(ended) < len(accepted) and time.monotonic() - killed_at < DRAIN_S:
            for job_id in [j for j in accepted if j not in ended]:
                try:
                    r = client.get(f"/v1/jobs/{job_id}")
                except httpx.TransportError:
                    continue
                if r.status_code == 200 and r.json()["status"] in TERMINAL:
                    ended[job_id] = r.json()
            time.sleep(0.5)
        drained_s = time.monotonic() - killed_at
        wrong = 0
        for job_id, job in ended.items():
            if (job["status"] != "succeeded" or job["text"] != clean[accepted[job_id] % 5]
                    or check_events(read_events(client, job_id), job["text"]) is not None):
                wrong += 1
    deadline = time.monotonic() + 120
    while not healthy(stack, 6) and time.monotonic() < deadline:
        time.sleep(0.5)
    lost = len(accepted) - len(ended)
    return {"round": rnd + 1, "killed": "seed" if target == seed else "other", "accepted": len(accepted),
            "lost": lost, "wrong": wrong, "stalled": lost > 0, "drained_s": round(drained_s, 1),
            "503s": counts["503"], "healed": healthy(stack, 6)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--jobs", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--tiny", action="store_true", help="a tiny random model instead of the default one")
    ap.add_argument("--workdir", default="")
    args = ap.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="conveyor-failover-"))
    model = make_tiny_model(work / "tiny", default_model()) if args.tiny else default_model()
    stack = start_stack(work / "stack", "", model, ENV, args=["--redis-cluster", "3"])
    rows = []
    try:
        with httpx.Client(base_url=stack.url, timeout=120) as client:
            clean = {}
            for i in range(5):
                job_id = submit(client, body(i, args.max_tokens), {"503": 0, "transport": 0})
                while True:
                    job = client.get(f"/v1/jobs/{job_id}").json()
                    if job["status"] in TERMINAL:
                        break
                    time.sleep(0.2)
                clean[i] = job["text"]
        for rnd in range(args.rounds):
            row = one_round(stack, rnd, args, clean)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        stop_stack(stack)
    keys = ["round", "killed", "accepted", "lost", "wrong", "stalled", "drained_s", "503s", "healed"]
    print(md_table(keys, [[r[k] for k in keys] for r in rows]))
    passed = sum(1 for r in rows if not r["lost"] and not r["wrong"] and r["healed"])
    print(f"\n{passed} of {len(rows)} rounds passed: every accepted job ended with its clean text")
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
