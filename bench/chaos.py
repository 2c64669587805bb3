"""Chaos run: nothing lost, nothing duplicated, while processes die and Redis restarts.

    .venv/bin/python -m bench faults chaos                        # 500 jobs, 3 rounds, real model
    .venv/bin/python -m bench faults chaos --jobs 60 --rounds 1   # a short one
    .venv/bin/python -m bench faults chaos --quick                # 20 jobs, 1 round, synthetic engine, no Redis restart

Starts a redis-server of its own (append-only, its port and data dir kept, so this script can
restart it) and `conveyor up --no-autoscale --tokenizers 2 --inference 2` on it (harness/stack.py), with fast
redelivery (CLAIM_IDLE_MS=3000, REFRESH_S=0.5, HEARTBEAT_S=1, DELIVERY_LIMIT=5).

1. Reference: every (prompt, params) of a fixed list runs twice through the same stack before any
   chaos (greedy, temperature 0): its text is what every later job with the same spec must end with.
2. Chaos: N jobs are submitted with a bounded number in flight (each with an Idempotency-Key, so a
   retried submission cannot make two jobs); in each of --rounds rounds one random tokenizer, one
   random inference worker and one random output lane (a spawn child of an inference worker) get
   SIGKILL, and in one round Redis is stopped (SIGTERM) and started again on the same port and data
   dir. Submissions answered 503 (or refused connections) during the outage are retried with
   backoff and counted. The supervisor restarts what was killed.
3. Check: every job must end (lost = never ended, must be 0); a succeeded job's text must equal the
   reference; its SSE replay (GET /v1/jobs/{id}/events) must have token seqs 1..n that concatenate to
   the final text. Exit status 1 if anything was lost or corrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import redis

from bench.common import PROMPTS, default_model, md_table, tree_state
from harness.sse import check_events, read_sse
from harness.stack import Stack, scan_log, start_stack, stop_stack
from infra.redis_server import RedisServer
from shared import names
from shared.jobs import TERMINAL


def specs() -> list[dict[str, Any]]:
    out = []
    for i, p in enumerate(PROMPTS):
        body: dict[str, Any] = {"temperature": 0, "max_tokens": (24, 32, 40, 48)[i % 4]}
        if i % 2 == 0:
            body["messages"] = [{"role": "user", "content": p}]
        else:
            body["prompt"] = p
        if i % 3 == 0:
            body["ignore_eos"] = True
        out.append(body)
    return out


def error_reason(msg: str) -> str:
    return re.sub(r"\d+", "N", msg or "")[:120]


class Run:
    def __init__(self, args: argparse.Namespace, stack: Stack, server: RedisServer) -> None:
        self.args, self.stack, self.server = args, stack, server
        self.r = redis.Redis.from_url(server.url, socket_timeout=3, socket_connect_timeout=2,
                                      decode_responses=True)
        self.rng = random.Random(args.seed)
        self.specs = specs()
        self.jobs: dict[str, int] = {}  # job id -> spec index
        self.ended: set[str] = set()
        self.submitted = 0
        self.retries = collections.Counter()
        self.retried_jobs = 0
        self.dup_ids = 0
        self.actions: list[list[Any]] = []
        self.t0 = time.monotonic()
        self.submit_done = asyncio.Event()
        self.outage_s = 0.0
        self.redis_down = False

    def log(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.1f}s] {msg}", flush=True)

    # --- submitting -------------------------------------------------------------------------
    async def submit(self, client: httpx.AsyncClient, body: dict[str, Any], key: str) -> str:
        backoff, retried = 0.2, False
        deadline = time.monotonic() + 300
        while True:
            try:
                resp = await client.post("/v1/jobs", json=body, headers={"Idempotency-Key": key}, timeout=30)
                if resp.status_code == 202:
                    if retried:
                        self.retried_jobs += 1
                    return str(resp.json()["id"])
                if resp.status_code != 503:
                    raise RuntimeError(f"submit -> {resp.status_code}: {resp.text[:300]}")
                self.retries["503"] += 1
            except httpx.TransportError as exc:
                self.retries[type(exc).__name__] += 1
            if time.monotonic() > deadline:
                raise RuntimeError("submission kept failing for 300 s")
            retried = True
            await asyncio.sleep(backoff * (0.5 + self.rng.random()))
            backoff = min(backoff * 2, 3.0)

    async def watch(self, ids: list[str]) -> None:
        """Mark ended jobs, reading their status straight from Redis (cheap for the API)."""
        left = [j for j in ids if j not in self.ended]
        if not left:
            return

        def read() -> list[Any]:
            pipe = self.r.pipeline(transaction=False)
            for j in left:
                pipe.hget(names.job_key(j), "status")
            return pipe.execute()

        try:
            statuses = await asyncio.to_thread(read)
        except redis.RedisError:
            return
        for j, st in zip(left, statuses):
            if st in TERMINAL:
                self.ended.add(j)

    async def watcher(self) -> None:
        while True:
            await self.watch(list(self.jobs))
            await asyncio.sleep(0.5)

    async def submitter(self, client: httpx.AsyncClient, lanes: int = 4) -> None:
        """`lanes` concurrent submitters share the job numbers; the in-flight bound is not applied
        while Redis is down (the watcher cannot see jobs end then), so the outage meets submissions."""
        numbers = iter(range(self.args.jobs))

        async def lane() -> None:
            for i in numbers:
                while self.submitted - len(self.ended) >= self.args.inflight and not self.redis_down:
                    await asyncio.sleep(0.05)
                idx = self.rng.randrange(len(self.specs))
                self.submitted += 1
                job_id = await self.submit(client, self.specs[idx], f"chaos-{self.args.run_id}-{i}")
                if job_id in self.jobs:
                    self.dup_ids += 1
                self.jobs[job_id] = idx

        await asyncio.gather(*(lane() for _ in range(lanes)))
        self.submit_done.set()
        self.log(f"all {len(self.jobs)} jobs submitted")

    # --- chaos ------------------------------------------------------------------------------------
    def kill(self, role: str, rnd: int) -> None:
        procs = self.stack.by_role(role)
        if not procs:
            self.actions.append([rnd, f"SIGKILL {role}", "-", f"{time.monotonic() - self.t0:.1f}", "none running"])
            self.log(f"no {role} to kill")
            return
        p = self.rng.choice(procs)
        note = ""
        if role == "output-lane":
            note = f"child of inference pid {p.ppid()}"
        p.kill()
        self.actions.append([rnd, f"SIGKILL {role}", p.pid, f"{time.monotonic() - self.t0:.1f}", note])
        self.log(f"round {rnd}: SIGKILL {role} pid {p.pid} {note}")

    def full_strength(self) -> bool:
        tree = self.stack.tree()
        count = collections.Counter(role for role, _ in tree)
        if count["tokenizer"] < 2 or count["inference"] < 2 or count["output-lane"] < 2 or count["api"] < 1:
            return False
        try:
            return httpx.get(self.stack.url + "/readyz", timeout=3).status_code == 200
        except httpx.HTTPError:
            return False

    async def restart_redis(self, rnd: int) -> None:
        t = time.monotonic()
        self.redis_down = True
        await asyncio.to_thread(self.server.stop)
        self.actions.append([rnd, "Redis SIGTERM", self.server.proc.pid if self.server.proc else "-",
                             f"{t - self.t0:.1f}", f"down {self.args.outage:.0f} s"])
        self.log(f"round {rnd}: Redis stopped")
        await asyncio.sleep(self.args.outage)
        await asyncio.to_thread(self.server.start)
        self.redis_down = False
        self.outage_s = time.monotonic() - t
        self.actions.append([rnd, "Redis start", self.server.proc.pid if self.server.proc else "-",
                             f"{time.monotonic() - self.t0:.1f}", "same port and data dir"])
        self.log(f"round {rnd}: Redis started again ({self.outage_s:.1f} s without it)")

    async def chaos(self) -> None:
        rounds, n = self.args.rounds, self.args.jobs
        redis_round = rounds // 2
        for rnd in range(rounds):
            trigger = int(n * (rnd + 0.5) / rounds)
            while self.submitted < trigger and not self.submit_done.is_set():
                await asyncio.sleep(0.2)
            for role in self.args.kill:
                await asyncio.to_thread(self.kill, role, rnd + 1)
                await asyncio.sleep(self.args.gap)
            if rnd == redis_round and not self.args.no_redis_restart:
                await self.restart_redis(rnd + 1)
            t = time.monotonic()
            while not await asyncio.to_thread(self.full_strength):
                if time.monotonic() - t > 180:
                    self.log(f"round {rnd + 1}: pools not back to full strength after 180 s")
                    break
                await asyncio.sleep(0.5)
            self.actions.append([rnd + 1, "back to full strength", "-", f"{time.monotonic() - self.t0:.1f}",
                                 f"{time.monotonic() - t:.1f} s after the last action"])
            self.log(f"round {rnd + 1}: full strength after {time.monotonic() - t:.1f} s")

    # --- reference ------------------------------------------------------------------------------------
    async def reference(self, client: httpx.AsyncClient) -> dict[int, set[str]]:
        ids = []
        for copy in range(self.args.ref_copies):
            for idx, body in enumerate(self.specs):
                ids.append((idx, await self.submit(client, body, f"ref-{self.args.run_id}-{copy}-{idx}")))
        deadline = time.monotonic() + 600
        refs: dict[int, list[str]] = collections.defaultdict(list)
        self.ref_usage: dict[int, set[int]] = collections.defaultdict(set)
        for idx, job_id in ids:
            while True:
                job = (await client.get(f"/v1/jobs/{job_id}")).json()
                if job["status"] in TERMINAL:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"reference job {job_id} did not end: {job}")
                await asyncio.sleep(0.2)
            if job["status"] != "succeeded":
                raise RuntimeError(f"reference job failed on a clean stack: {job}")
            refs[idx].append(job["text"])
            self.ref_usage[idx].add(job["usage"]["completion_tokens"])
        self.ref_variants = {i: len(set(t)) for i, t in refs.items()}
        for i, v in self.ref_variants.items():
            if v > 1:
                self.log(f"reference spec {i} gave {v} different texts on a clean stack: {refs[i]!r}")
        return {i: set(t) for i, t in refs.items()}


async def poll(run: Run, client: httpx.AsyncClient, job_id: str) -> dict[str, Any]:
    """A job's poll as a client makes it: a 503 (Retry-After) or a dropped connection is asked again, for up to
    60 s, and counted; any other answer is the job's."""
    deadline = time.monotonic() + 60
    while True:
        try:
            resp = await client.get(f"/v1/jobs/{job_id}", timeout=30)
            if resp.status_code != 503 or time.monotonic() > deadline:
                return dict(resp.json())
            run.retries["poll 503"] += 1
        except httpx.TransportError as exc:
            if time.monotonic() > deadline:
                raise
            run.retries[f"poll {type(exc).__name__}"] += 1
        await asyncio.sleep(0.5)


async def verify(run: Run, client: httpx.AsyncClient, refs: dict[int, set[str]]) -> dict[str, Any]:
    sem = asyncio.Semaphore(8)
    res: dict[str, Any] = {"status": collections.Counter(), "failed": collections.Counter(), "corrupt": [],
                           "replay_bad": [], "usage_bad": [], "lost": [], "cancelled": 0}

    async def one(job_id: str, idx: int) -> None:
        async with sem:
            job = await poll(run, client, job_id)
            st = job.get("status")
            res["status"][st] += 1
            if st not in TERMINAL:
                res["lost"].append({"id": job_id, "status": st, "tokens": job.get("usage", {}),
                                    "answer": job.get("error")})  # a poll's error (not a job) names itself
                return
            if st == "failed":
                res["failed"][error_reason(job.get("error") or "")] += 1
            if st == "succeeded":
                if job["text"] not in refs[idx]:
                    res["corrupt"].append({"id": job_id, "spec": idx, "text": job["text"],
                                           "reference": sorted(refs[idx])})
                usage = job["usage"]["completion_tokens"]
                if usage not in run.ref_usage[idx]:
                    res["usage_bad"].append({"id": job_id, "spec": idx, "completion_tokens": usage,
                                             "reference": sorted(run.ref_usage[idx])})
            try:
                events = await read_sse(client, f"/v1/jobs/{job_id}/events", timeout=60)
                bad = check_events(events, job.get("text") or "")
            except Exception as exc:  # noqa: BLE001 - reported, not raised
                bad = f"replay failed: {exc}"
            if bad:
                res["replay_bad"].append({"id": job_id, "problem": bad})

    await asyncio.gather(*(one(j, i) for j, i in run.jobs.items()))
    return res


async def main_async(args: argparse.Namespace, stack: Stack, server: RedisServer) -> int:
    run = Run(args, stack, server)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=32)
    async with httpx.AsyncClient(base_url=stack.url, timeout=30, limits=limits) as client:
        run.log("reference pass (clean stack)")
        refs = await run.reference(client)
        t_ref = time.monotonic() - run.t0
        run.log(f"reference done in {t_ref:.1f} s: {len(refs)} specs")
        run.t0 = time.monotonic()
        watcher = asyncio.create_task(run.watcher())
        chaos = asyncio.create_task(run.chaos())
        await run.submitter(client)
        t_submitted = time.monotonic() - run.t0
        deadline = time.monotonic() + args.deadline
        while len(run.ended) < len(run.jobs) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        t_ended = time.monotonic() - run.t0
        await chaos
        watcher.cancel()
        run.log(f"{len(run.ended)}/{len(run.jobs)} jobs ended after {t_ended:.1f} s; verifying")
        res = await verify(run, client, refs)

    lost = len(res["lost"])
    corrupt = len(res["corrupt"]) + len(res["replay_bad"]) + run.dup_ids
    logscan = scan_log(stack.log)
    failed = sum(res["failed"].values())
    rows = [
        ["submitted", len(run.jobs)],
        ["succeeded", res["status"]["succeeded"]],
        ["failed", failed if not failed else f"{failed}: " + "; ".join(
            f"{n}× {reason}" for reason, n in res["failed"].most_common())],
        ["cancelled", res["status"]["cancelled"]],
        ["**lost** (never ended)", lost],
        ["**text ≠ clean greedy reference**", len(res["corrupt"])],
        ["**SSE replay ≠ final text or seqs not 1..n**", len(res["replay_bad"])],
        ["completion_tokens ≠ reference", len(res["usage_bad"])],
        ["two submissions → same job id", run.dup_ids],
        ["submissions retried (503 / connection refused during the outage)",
         f"{run.retried_jobs} jobs, {sum(run.retries.values())} retries "
         f"({', '.join(f'{k}: {v}' for k, v in sorted(run.retries.items())) or 'none'})"],
        ["Redis outage", f"{run.outage_s:.1f} s" if run.outage_s else "none"],
        [f"chaos rounds (SIGKILL {' + '.join(args.kill) or 'nothing'})", args.rounds],
        ["all jobs submitted / ended after", f"{t_submitted:.0f} s / {t_ended:.0f} s"],
        ["reference specs (texts differing between clean runs)",
         f"{len(refs)} ({sum(v > 1 for v in run.ref_variants.values())})"],
        ["workers restarted by the supervisor (log)", len(logscan["exits"])],
        ["entries claimed from dead workers (log)", logscan["claims"]],
        ["tracebacks / ERROR lines in the stack log", f"{logscan['tracebacks']} / {len(logscan['errors'])}"],

        ["code", args.code if tree_state() == args.code else f"{args.code}, CHANGED during the run"],
    ]
    print()
    print(md_table(["chaos", "result"], rows))
    print()
    print(md_table(["round", "action", "pid", "t (s)", "note"], run.actions))
    print()
    out = {"rows": rows, "actions": run.actions, "lost": res["lost"], "corrupt": res["corrupt"],
           "replay_bad": res["replay_bad"], "usage_bad": res["usage_bad"], "failed": dict(res["failed"]),
           "retries": dict(run.retries), "log": {k: v for k, v in logscan.items()}, "args": vars(args)}
    (Path(args.workdir) / "chaos.json").write_text(json.dumps(out, indent=1, default=str))
    print(f"details: {Path(args.workdir) / 'chaos.json'}; stack log: {stack.log}")
    for kind in ("lost", "corrupt", "replay_bad", "usage_bad"):
        for item in res[kind][:5]:
            print(f"{kind}: {json.dumps(item)[:600]}")
    if logscan["errors"]:
        print("ERROR lines (first 10):")
        for ln in logscan["errors"][:10]:
            print("  " + ln[:300])
    if logscan["warnings"]:
        print("WARNING lines by kind:")
        for msg, n in sorted(logscan["warnings"].items(), key=lambda kv: -kv[1])[:15]:
            print(f"  {n:5d}× {msg}")
    return 1 if lost or corrupt else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--inflight", type=int, default=48, help="most jobs submitted and not yet ended")
    ap.add_argument("--workdir", default="/tmp/conveyor-chaos", help="redis data, cache, stack.log, chaos.json")
    ap.add_argument("--model", default=None, help="model directory (default: the service's default model)")
    ap.add_argument("--engine", default="torch", choices=["torch", "synthetic"])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--gap", type=float, default=1.5, help="seconds between the kills of a round")
    ap.add_argument("--outage", type=float, default=4.0, help="seconds Redis stays down")
    ap.add_argument("--no-redis-restart", action="store_true")
    ap.add_argument("--kill", default="tokenizer,inference,output-lane",
                    help="roles to SIGKILL each round, comma-separated ('' for none: only the Redis restart)")
    ap.add_argument("--ref-copies", type=int, default=2, help="clean runs per spec for the reference")
    ap.add_argument("--deadline", type=float, default=900.0, help="seconds after the last submission")
    ap.add_argument("--quick", action="store_true",
                    help="seconds: 20 jobs, 1 round of kills, no Redis restart, the synthetic engine")
    args = ap.parse_args(argv)
    if args.quick:
        args.jobs, args.rounds, args.inflight, args.engine, args.ref_copies = 20, 1, 8, "synthetic", 1
        args.gap, args.outage, args.deadline, args.no_redis_restart = 0.3, 1.0, 120.0, True
    args.model = args.model or default_model()
    args.run_id = f"{int(time.time())}"
    args.kill = [r for r in args.kill.split(",") if r]
    args.code = tree_state()
    work = Path(args.workdir)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    server = RedisServer(work / "redis", appendonly=True)  # restarts keep its port
    server.start()
    env = {"CLAIM_IDLE_MS": "3000", "REFRESH_S": "0.5", "HEARTBEAT_S": "1", "DELIVERY_LIMIT": "5",
           "DRAIN_GRACE_S": "10", "TORCH_THREADS": "1", "ENGINE": args.engine, "LOG_LEVEL": "INFO",
           "PYTHONUNBUFFERED": "1"}
    code = 2
    stack = None
    try:
        stack = start_stack(work / "stack", server.url, args.model, env, ["--tokenizers", "2", "--inference", "2"],
                            timeout=300)
        code = asyncio.run(main_async(args, stack, server))
    finally:
        if server.proc is None or server.proc.poll() is not None:
            server.start()  # let the workers drain against a live Redis
        left = stop_stack(stack) if stack is not None else []
        server.stop()
        if left:
            print(f"processes that outlived the stack and were killed: {left}")
    return code
