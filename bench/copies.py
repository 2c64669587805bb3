"""What the durability mechanism costs in accepted jobs/s on a Redis Cluster.

    .venv/bin/python -m bench faults copies                              # 3 masters + 3 replicas, ~25 s
    .venv/bin/python -m bench faults copies --concurrency 32 --seconds 5 --runs 5

On a cluster the API's submit (`AsyncJobOps.submit`) sends submit.lua and `WAIT 1 1000` in one pipeline
to the job's master, on the same connection, and answers only once a replica has the job (else
NotCopied, a 503). This starts its own LocalCluster (3 masters, 1 replica each, in a temporary
directory; `appendfsync always` on every node, as LocalCluster sets it by default), names keys for 12
partitions (so jobs spread over every master), and drives submits from --concurrency asyncio tasks
for --seconds in two modes, interleaved (copied, plain, copied, plain, ... for --runs pairs):

- copied: `AsyncJobOps(client, ttl).submit(job_id, record, request_json)`, as the API calls it;
- plain:  the same `submit_write` sent by `scripts.SUBMIT.acall(client, *write)`, with no WAIT: what a
          submit that promises only the master's copy costs.

It reports each run's accepted jobs/s per mode and their ratio (copied / plain), the median ratio,
and each mode's p50/p99 submit latency. The client (one asyncio loop) and the six redis-servers share
this machine's cores, so the figures are of this machine, not of a cluster with a host per node: the
`client CPU` column (the benchmark process's CPU time over the run's wall time) says how near one core
the client itself was.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import fmt, md_table, parser, percentile, tree_state
from infra.redis_cluster import LocalCluster
from shared import names, scripts
from shared.job_ops import AsyncJobOps, NotCopied, submit_write
from shared.jobs import new_record
from shared.redis_client import async_client
from shared.scripts.codes import SubmitCode, SubmitReply

PARTITIONS = 12
TTL_S = 3600
REQUEST = json.dumps({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                      "max_tokens": 16})
MODES = ("copied", "plain")


def new_job() -> tuple[str, dict[str, Any], str]:
    job_id = names.job_id_in(random.randrange(PARTITIONS), uuid.uuid4().hex)
    return job_id, new_record(job_id, "m", REQUEST), REQUEST


async def submit_copied(ops: AsyncJobOps, client: Any) -> bool:
    job_id, record, request_json = new_job()
    return (await ops.submit(job_id, record, request_json)).code is SubmitCode.accepted


async def submit_plain(ops: AsyncJobOps, client: Any) -> bool:
    job_id, record, request_json = new_job()
    write = submit_write(job_id, record, request_json, ops.ttl_s)
    return SubmitReply.parse(await scripts.SUBMIT.acall(client, *write)).code is SubmitCode.accepted


async def drive(mode: str, ops: AsyncJobOps, client: Any, concurrency: int, seconds: float) -> dict[str, Any]:
    """`concurrency` tasks submitting back to back for `seconds`: accepted jobs, refusals, NotCopied, latencies."""
    call = submit_copied if mode == "copied" else submit_plain
    latencies: list[float] = []
    counts = {"accepted": 0, "refused": 0, "not_copied": 0}
    deadline = time.monotonic() + seconds

    async def worker() -> None:
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            try:
                ok = await call(ops, client)
            except NotCopied:
                counts["not_copied"] += 1
                continue
            latencies.append(time.perf_counter() - t0)
            counts["accepted" if ok else "refused"] += 1

    t0, cpu0 = time.monotonic(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    return {"mode": mode, "wall": wall, "cpu": cpu / wall, "latencies": latencies,
            "rate": counts["accepted"] / wall, **counts}


def node_config(cluster: LocalCluster) -> str:
    """Each role's appendonly/appendfsync as the nodes report them (CONFIG GET), and the Redis version."""
    parts = []
    for role, ports in (("masters", cluster.master_ports()), ("replicas", cluster.replica_ports())):
        seen = set()
        for port in ports:
            with cluster.node(port).client() as c:
                conf = c.config_get("append*")
                version = c.info("server")["redis_version"]
            seen.add(f"appendonly {conf['appendonly']}, appendfsync {conf['appendfsync']}")
        parts.append(f"{len(ports)} {role}: {' / '.join(sorted(seen))}")
    return f"redis-server {version}; " + "; ".join(parts)


def spread(client: Any) -> dict[str, int]:
    """How many of the PARTITIONS partitions each master serves (its job keys' slots)."""
    out: dict[str, int] = {}
    for p in range(PARTITIONS):
        node = client.get_node_from_key(names.job_key(names.job_id_in(p, "0" * 32)))
        out[node.name] = out.get(node.name, 0) + 1
    return out


async def bench(cluster: LocalCluster, args: argparse.Namespace) -> None:
    client = async_client(cluster.seed_url)
    try:
        await client.initialize()
        ops = AsyncJobOps(client, TTL_S)
        print(f"{node_config(cluster)}; {os.cpu_count()} CPUs shared by the client and every node; "
              f"code {tree_state()}")
        print(f"{PARTITIONS} partitions over the masters: "
              + ", ".join(f"{k} {v}" for k, v in sorted(spread(client).items())))
        print(f"{args.concurrency} concurrent submit tasks, {args.seconds:g} s per run, "
              f"{args.runs} interleaved pairs (copied = submit.lua + WAIT 1 1000 in one pipeline; "
              "plain = submit.lua alone)\n")
        for mode in MODES:  # connections to every master, the slot map, Lua compiled: outside the timed runs
            await drive(mode, ops, client, args.concurrency, args.warmup)
        runs: list[tuple[dict[str, Any], dict[str, Any]]] = []
        for _ in range(args.runs):
            copied = await drive("copied", ops, client, args.concurrency, args.seconds)
            plain = await drive("plain", ops, client, args.concurrency, args.seconds)
            runs.append((copied, plain))
    finally:
        await client.aclose()

    rows = []
    for i, (copied, plain) in enumerate(runs, 1):
        ratio = copied["rate"] / plain["rate"] if plain["rate"] else float("nan")
        rows.append([i, fmt(copied["rate"]), fmt(plain["rate"]), fmt(ratio, 3),
                     f"{copied['not_copied']} / {copied['refused']}", f"{plain['refused']}",
                     f"{copied['cpu']:.0%} / {plain['cpu']:.0%}"])
    ratios = [c["rate"] / p["rate"] for c, p in runs if p["rate"]]
    median = statistics.median(ratios) if ratios else float("nan")
    rows.append(["median", fmt(statistics.median(c["rate"] for c, _ in runs)),
                 fmt(statistics.median(p["rate"] for _, p in runs)), fmt(median, 3), "", "", ""])
    print(md_table(["run", "copied jobs/s", "plain jobs/s", "copied / plain",
                    "copied: NotCopied / refused", "plain: refused", "client CPU copied / plain"], rows))
    print()
    lat_rows = []
    for k, mode in enumerate(MODES):
        lats = [x * 1e3 for pair in runs for x in pair[k]["latencies"]]
        lat_rows.append([mode, f"{len(lats):,}", fmt(percentile(lats, 50), 2), fmt(percentile(lats, 99), 2)])
    print(md_table(["mode", "submits timed (all runs)", "p50 ms", "p99 ms"], lat_rows))
    print(f"\ncopied keeps {median:.1%} of plain's accepted jobs/s (median of {len(ratios)} pairs); the cost of "
          f"the replica's copy (with its appendfsync always) is {1 - median:.1%}.")


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__, model=False)
    p.add_argument("--concurrency", type=int, default=16, help="concurrent submit tasks")
    p.add_argument("--seconds", type=float, default=3.0, help="seconds per run")
    p.add_argument("--runs", type=int, default=3, help="interleaved (copied, plain) pairs")
    p.add_argument("--warmup", type=float, default=0.5, help="seconds of each mode before the timed runs")
    args = p.parse_args(argv)
    if args.quick:
        args.seconds, args.runs, args.warmup = 0.5, 1, 0.1
    with tempfile.TemporaryDirectory(prefix="conveyor-copies-") as tmp, names.partitions_as(PARTITIONS):
        cluster = LocalCluster(Path(tmp) / "cluster", masters=3, replicas=1)
        try:
            cluster.start()
            asyncio.run(bench(cluster, args))
        finally:
            cluster.stop()
