"""Soak: does any process of the stack, or Redis, grow over many jobs?

    .venv/bin/python -m bench soak --jobs 10000 --csv /tmp/soak.csv        # synthetic engine
    .venv/bin/python -m bench soak --jobs 2000 --engine torch --rate 3      # the real model
    .venv/bin/python -m bench soak --quick                                  # seconds: 30 jobs, 5 s TTL

Starts `conveyor up --no-autoscale` (harness/stack.py; its own redis-server, under --workdir) with
ENGINE=synthetic by default: the synthetic engine is a zero-cost benchmark instrument (one fixed
token per running request per step, no model), so the soak exercises the plumbing (API, tokenizer
pool, reader lane, output lane, relay, Redis) at many jobs per second. `--engine torch` runs the
real model. JOB_TTL_S is small (60 s by default) so job records, event streams and token keys
expire during the run: key count and Redis memory must plateau, not grow with the job count.

Submits --jobs jobs at a steady --rate with at most --inflight in flight; --sse of them are read
as SSE streams (their replay checked against the final text), the others are polled. Every
--sample-s seconds it samples the RSS of every process of the stack (psutil over the supervisor's
process tree: redis-server, api, tokenizers, inference workers and their output lanes) and Redis
INFO memory used_memory and DBSIZE. Reports per process the RSS after warm-up (the first sample
once --warmup of the jobs have ended and 1.5 x JOB_TTL_S have passed, so expiry has reached its
steady state) against the end (right after the last job ended), and the growth; the goal is under
1%. Then it stays idle for JOB_TTL_S + 10 s and samples once more: every job's keys should be gone.
Writes every sample to --csv.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import csv
import json
import random
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import redis

from bench.common import PROMPTS, default_model, md_table, quick_model, tree_state
from harness.sse import check_events, read_sse
from harness.stack import Stack, scan_log, start_stack, stop_stack
from shared import names
from shared.jobs import TERMINAL


class Soak:
    def __init__(self, args: argparse.Namespace, stack: Stack) -> None:
        self.args, self.stack = args, stack
        self.r = redis.Redis.from_url(stack.redis_url, socket_timeout=5, decode_responses=True)
        self.rng = random.Random(args.seed)
        self.submitted = 0
        self.done = 0
        self.status: collections.Counter[str] = collections.Counter()
        self.problems: list[str] = []
        self.e2e: list[float] = []
        self.slow: list[tuple[float, dict[str, Any]]] = []  # the slowest jobs, for the report
        self.samples: list[dict[str, Any]] = []
        self.t0 = time.monotonic()

    def log(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.1f}s] {msg}", flush=True)

    # --- load ------------------------------------------------------------------------------------------
    async def job(self, client: httpx.AsyncClient, i: int) -> None:
        body: dict[str, Any] = {"max_tokens": self.rng.randint(8, self.args.max_tokens), "temperature": 0}
        p = self.rng.choice(PROMPTS)
        if i % 2:
            body["messages"] = [{"role": "user", "content": p}]
        else:
            body["prompt"] = p
        if self.args.engine == "torch" and i % 3 == 0:
            body["ignore_eos"] = True
        t = time.monotonic()
        job: dict[str, Any] = {}
        try:
            resp = await client.post("/v1/jobs", json=body)
            if resp.status_code != 202:
                self.problems.append(f"submit -> {resp.status_code}: {resp.text[:200]}")
                self.status["not submitted"] += 1
                return
            job_id = resp.json()["id"]
            if self.rng.random() < self.args.sse:
                events = await read_sse(client, f"/v1/jobs/{job_id}/events", timeout=300)
                done = [e for e in events if e.get("event") == "done"]
                job = json.loads(done[-1]["data"]) if done else (await client.get(f"/v1/jobs/{job_id}")).json()
                bad = check_events(events, job.get("text") or "")
                if bad:
                    self.problems.append(f"{job_id}: {bad}")
                self.status["sse " + job.get("status", "?")] += 1
            else:
                while True:
                    await asyncio.sleep(self.args.poll_s)
                    r = await client.get(f"/v1/jobs/{job_id}")
                    if r.status_code != 200:
                        self.problems.append(f"{job_id}: poll -> {r.status_code} {r.text[:200]}")
                        self.status[f"poll http {r.status_code}"] += 1
                        break
                    job = r.json()
                    if job["status"] in TERMINAL:
                        self.status["poll " + job["status"]] += 1
                        break
            self.e2e.append(time.monotonic() - t)
            self.slow.append((self.e2e[-1], job))
            self.slow = sorted(self.slow, key=lambda x: -x[0])[:3]
        except Exception as exc:  # noqa: BLE001 - counted and reported
            self.problems.append(f"job {i}: {type(exc).__name__}: {exc}")
            self.status["client error"] += 1
        finally:
            self.done += 1

    async def load(self, client: httpx.AsyncClient) -> None:
        sem = asyncio.Semaphore(self.args.inflight)
        tasks: set[asyncio.Task[None]] = set()
        start = time.monotonic()

        async def run(i: int) -> None:
            try:
                await self.job(client, i)
            finally:
                sem.release()

        for i in range(self.args.jobs):
            delay = start + i / self.args.rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await sem.acquire()
            task = asyncio.create_task(run(i))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            self.submitted += 1
            if (i + 1) % max(1, self.args.jobs // 10) == 0:  # progress
                self.log(f"{i + 1} submitted, {self.done} ended, {self.args.inflight - sem._value} in flight")
        await asyncio.gather(*tasks)

    # --- sampling ---------------------------------------------------------------------------------------
    def sample(self) -> dict[str, Any]:
        procs: dict[str, tuple[int, int]] = {}
        counts: collections.Counter[str] = collections.Counter()
        tree = sorted(self.stack.tree(), key=lambda rp: (rp[0], rp[1].pid))
        by_pid_role = {}
        for role, p in tree:
            by_pid_role[p.pid] = role
        for role, p in tree:
            if role in ("supervisor", "mp-helper", "other"):
                label = f"{role}" if role == "supervisor" else f"{role}:{p.pid}"
            elif role == "output-lane":
                parent = p.ppid()
                label = f"output-lane (of inference:{parent})"
            else:
                counts[role] += 1
                label = f"{role}" if role in ("api", "redis-server") else f"{role}:{p.pid}"
            try:
                procs[label] = (p.pid, p.memory_info().rss)
            except Exception:  # noqa: BLE001 - the process went away between listing and reading
                continue
        try:
            info = self.r.info("memory")
            used, dbsize = int(info["used_memory"]), int(self.r.dbsize())
        except redis.RedisError:
            used, dbsize = -1, -1
        return {"t": time.monotonic() - self.t0, "done": self.done, "submitted": self.submitted, "procs": procs,
                "used_memory": used, "dbsize": dbsize}

    async def sampler(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.samples.append(await asyncio.to_thread(self.sample))
            try:
                await asyncio.wait_for(stop.wait(), self.args.sample_s)
            except TimeoutError:
                pass

    def key_breakdown(self) -> dict[str, int]:
        kinds: collections.Counter[str] = collections.Counter()
        for key in self.r.scan_iter(count=1000):
            parts = key.split(":")
            n = 3 if len(parts) > 1 and parts[1].startswith("{") else 2  # conveyor:{p0}:job:<id> -> conveyor:{p0}:job
            kinds[":".join(parts[:n]) if len(parts) > n else key] += 1
        return dict(kinds.most_common())


def fmt_mb(b: int) -> str:
    return f"{b / 2**20:.1f}"


def growth(a: int, b: int) -> str:
    return f"{(b - a) / a * 100:+.2f}%" if a > 0 else "n/a"


async def main_async(args: argparse.Namespace, stack: Stack) -> int:
    soak = Soak(args, stack)
    limits = httpx.Limits(max_connections=args.inflight + 16, max_keepalive_connections=args.inflight + 16)
    async with httpx.AsyncClient(base_url=stack.url, timeout=60, limits=limits) as client:
        stop = asyncio.Event()
        sampler = asyncio.create_task(soak.sampler(stop))
        await soak.load(client)
        elapsed = time.monotonic() - soak.t0
        soak.log(f"{soak.done} jobs ended in {elapsed:.0f} s; idle for {args.idle:g} s so the last records expire")
        end = await asyncio.to_thread(soak.sample)
        soak.samples.append(end)
        await asyncio.sleep(args.idle)
        stop.set()
        await sampler
        idle = await asyncio.to_thread(soak.sample)
        soak.samples.append(idle)

    with open(args.csv, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t_s", "jobs_submitted", "jobs_ended", "process", "pid", "rss_bytes", "redis_used_memory",
                    "redis_dbsize"])
        for s in soak.samples:
            for label, (pid, rss) in s["procs"].items():
                w.writerow([f"{s['t']:.1f}", s["submitted"], s["done"], label, pid, rss, s["used_memory"], s["dbsize"]])

    # the baseline: once --warmup of the jobs have ended and the first records have had time to expire
    settle = args.ttl * 1.5
    loaded = [s for s in soak.samples if s["t"] <= end["t"] and s["done"] >= args.warmup * args.jobs]
    warm = next((s for s in loaded if s["t"] >= settle), loaded[0])
    rows = []
    labels = list(dict.fromkeys(label for s in soak.samples for label in s["procs"]))
    restarted = []
    for label in labels:
        if label not in warm["procs"] or label not in end["procs"]:
            restarted.append(label)
            continue
        a, b = warm["procs"][label][1], end["procs"][label][1]
        peak = max(s["procs"][label][1] for s in soak.samples if label in s["procs"] and s["t"] >= warm["t"])
        c = idle["procs"].get(label, (0, 0))[1]
        rows.append([label, fmt_mb(a), fmt_mb(b), fmt_mb(peak), growth(a, b), fmt_mb(c)])
    tot_a = sum(v[1] for v in warm["procs"].values())
    tot_b = sum(v[1] for v in end["procs"].values())
    tot_c = sum(v[1] for v in idle["procs"].values())
    rows.append(["**all processes**", fmt_mb(tot_a), fmt_mb(tot_b), "", growth(tot_a, tot_b), fmt_mb(tot_c)])
    post = [s for s in soak.samples if warm["t"] <= s["t"] <= end["t"] and s["used_memory"] >= 0]
    rows.append(["Redis used_memory", fmt_mb(warm["used_memory"]), fmt_mb(end["used_memory"]),
                 fmt_mb(max(s["used_memory"] for s in post)), growth(warm["used_memory"], end["used_memory"]),
                 fmt_mb(idle["used_memory"])])
    rows.append(["Redis DBSIZE (keys)", warm["dbsize"], end["dbsize"], max(s["dbsize"] for s in post),
                 growth(warm["dbsize"], end["dbsize"]), idle["dbsize"]])
    print()
    print(md_table(["process", f"RSS MiB after warm-up ({warm['done']} jobs, t={warm['t']:.0f}s)",
                    f"RSS MiB at the end ({end['done']} jobs, t={end['t']:.0f}s)", "peak after warm-up", "growth",
                    f"after {args.idle:g} s idle"],
                   rows))
    ok = sum(v for k, v in soak.status.items() if k.endswith("succeeded"))
    e2e = sorted(soak.e2e)
    try:
        keys = soak.key_breakdown()
        lens = {s: soak.r.xlen(s) for kind in (names.JOBS, names.TOKENIZED, names.ENDED, names.DEAD)
                for s in names.streams(kind)}
    except redis.RedisError as exc:
        keys, lens = {"error": str(exc)}, {}
    logscan = scan_log(stack.log)
    summary = [
        ["engine", args.engine + (" (zero-cost benchmark instrument)" if args.engine == "synthetic" else "")],
        ["jobs", f"{soak.done} ended of {args.jobs}: {', '.join(f'{k} {v}' for k, v in sorted(soak.status.items()))}"],
        ["succeeded", ok],
        ["problems (SSE replay ≠ text, HTTP errors)", len(soak.problems)],
        ["rate asked / achieved", f"{args.rate:g} / {soak.done / elapsed:.1f} jobs/s, ≤ {args.inflight} in flight"],
        ["job latency p50 / p90 / p99 / max (client)",
         f"{statistics.median(e2e):.2f} / {e2e[int(len(e2e) * .9) - 1]:.2f} / {e2e[int(len(e2e) * .99) - 1]:.2f}"
         f" / {e2e[-1]:.2f} s" if e2e else "n/a"],
        ["JOB_TTL_S", f"{args.ttl} (every per-job key expires during the run)"],
        ["keys at the end", ", ".join(f"{k} {v}" for k, v in keys.items())],
        ["stream lengths at the end", ", ".join(f"{k} {v}" for k, v in lens.items())],
        ["samples", f"{len(soak.samples)} every {args.sample_s:g} s -> {args.csv}"],
        ["processes not present from warm-up to end (restarted?)", ", ".join(restarted) or "none"],
        ["worker exits / tracebacks / ERROR lines (stack log)",
         f"{len(logscan['exits'])} / {logscan['tracebacks']} / {len(logscan['errors'])}"],

        ["code", args.code if tree_state() == args.code else f"{args.code}, CHANGED during the run"],
    ]
    print()
    print(md_table(["soak", "result"], summary))
    for took, job in soak.slow:
        c, s0, f0, e0 = (job.get(k) or 0 for k in ("created_at", "started_at", "first_token_at", "finished_at"))
        print(f"slow job {job.get('id')}: {took:.2f} s at the client; queued {s0 - c:.2f} s, first token after "
              f"{f0 - c:.2f} s, generation {e0 - f0:.2f} s, {job.get('usage', {}).get('completion_tokens')} tokens")
    for p in soak.problems[:10]:
        print("problem:", p[:300])
    for ln in logscan["errors"][:10]:
        print("ERROR:", ln[:300])
    for msg, n in sorted(logscan["warnings"].items(), key=lambda kv: -kv[1])[:10]:
        print(f"WARNING {n}×: {msg}")
    return 1 if soak.problems or ok != args.jobs else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--rate", type=float, default=25.0, help="jobs submitted per second (at most)")
    ap.add_argument("--inflight", type=int, default=48)
    ap.add_argument("--sse", type=float, default=0.3, help="share of jobs read as SSE streams (the rest polled)")
    ap.add_argument("--poll-s", type=float, default=0.5)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--engine", default="synthetic", choices=["synthetic", "torch"])
    ap.add_argument("--tokenizers", type=int, default=2)
    ap.add_argument("--inference", type=int, default=2)
    ap.add_argument("--ttl", type=int, default=60, help="JOB_TTL_S for the stack")
    ap.add_argument("--warmup", type=float, default=0.2, help="share of jobs before the baseline sample")
    ap.add_argument("--sample-s", type=float, default=3.0)
    ap.add_argument("--idle", type=float, default=-1, help="seconds to stay idle after the last job before the "
                    "last sample (default: JOB_TTL_S + 10, so every record has expired)")
    ap.add_argument("--workdir", default="/tmp/conveyor-soak")
    ap.add_argument("--csv", default="soak.csv")
    ap.add_argument("--model", default=None, help="model directory (default: the service's default model)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="seconds: 30 jobs at 60/s, polled every 0.1 s, JOB_TTL_S 5, "
                    "one worker each, 0.5 s idle")
    args = ap.parse_args(argv)
    if args.quick:
        args.jobs, args.rate, args.inflight, args.ttl, args.sample_s, args.idle = 30, 60.0, 8, 5, 0.5, 0.5
        args.tokenizers, args.inference, args.max_tokens, args.poll_s = 1, 1, 16, 0.1
    args.model = quick_model(args.model) if args.quick and args.engine == "torch" else args.model or default_model()
    if args.idle < 0:
        args.idle = args.ttl + 10.0
    args.code = tree_state()
    work = Path(args.workdir)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    env = {"ENGINE": args.engine, "JOB_TTL_S": str(args.ttl), "TORCH_THREADS": "1", "LOG_LEVEL": "INFO",
           "PYTHONUNBUFFERED": "1"}
    stack = start_stack(work, None, args.model, env, ["--tokenizers", str(args.tokenizers), "--inference",
                                                      str(args.inference)], timeout=300)
    code = 2
    try:
        code = asyncio.run(main_async(args, stack))
    finally:
        left = stop_stack(stack)
        if left:
            print(f"processes that outlived the stack and were killed: {left}")
    return code
