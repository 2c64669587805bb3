"""Plumbing benchmark: what one API process carries when generation costs nothing.

    .venv/bin/python -m bench serve plumbing                    # everything (about 5 minutes)
    .venv/bin/python -m bench serve plumbing --quick            # seconds: every part once, small and short
    .venv/bin/python -m bench serve plumbing --only relay --relay-n 1,100,1000
    .venv/bin/python -m bench serve plumbing --only accept-cluster   # one Redis node against a 3-master cluster

It starts its own stack (harness/stack.py: `conveyor up --no-autoscale`, its own redis-server) with
ENGINE=synthetic: the zero-cost synthetic engine, a benchmark instrument that emits one fixed token
per running request per step with no model, so only the plumbing is measured. One API process.

(a) accept: jobs/s answered 202 by `POST /v1/jobs` (body `{"prompt": "Hello", "max_tokens": 1}`),
    from P client processes of C keep-alive connections each (a minimal asyncio HTTP/1.1 client,
    much cheaper than httpx), and from `wrk` with a Lua script when `wrk` is installed. Twice:
    with the worker pools paused (SIGSTOP: the API and Redis alone; the queued jobs are trimmed
    afterwards) and with them consuming (the whole stack on the same cores).
(b) streams: N jobs with --stream-tokens tokens each, one SSE stream per job on
    `/v1/jobs/{id}/events`. The inference worker is paused until every stream is open (each has
    its `status` event), so N streams are held at once; then it runs them all. Reports the API
    process's RSS (psutil) idle, with N streams held and at peak, Redis connections (`CLIENT LIST`),
    and checks that every stream received every token, in order, and its `done` event.
(c) relay delay: N job records made here, one SSE client each; a publisher in this process writes
    token events with the output lane's own step write (`shared.job_ops.step_write` + `JobOps.step`:
    per tick, one STEP script call for a group of jobs in one MULTI/EXEC), with the wall-clock
    publish time in the text. Delay = client receive time - publish time, per token event, p50/p99/max.

(d) accept-cluster: a stack on one redis-server and a stack on a local Redis Cluster (`conveyor up
    --redis-cluster 3`: 3 masters, 3 replicas, 12 partitions) up at once, rounds alternating between
    them: (a) with the workers paused, then (c) at --relay-n streams; with the Redis processes' CPU
    per accepted job and per relayed event (replicas included): the per-operation cost that sizes a
    deployment (two cores show no scale-out).

Clients, publisher, API, Redis and the (idle) workers all share this machine's cores: the figures
are for that, and say how many client processes drove them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import aclosing
from pathlib import Path
from typing import Any

import psutil

from bench.common import default_model, percentile
from harness.sse import HttpStatusError, raw_events
from harness.stack import Stack, start_stack, stop_stack

SUBMIT_BODY = b'{"prompt": "Hello", "max_tokens": 1}'
OPEN_ATTEMPTS = 10


# ----------------------------------------------------------------------------- the stack


def start(args: argparse.Namespace, workdir: Path, extra: dict[str, str] | None = None,
          up_args: list[str] | None = None) -> Stack:
    print(f"[stack] starting (ENGINE=synthetic, log {workdir / 'stack.log'})", file=sys.stderr, flush=True)
    env = {"ENGINE": "synthetic", "MAX_NUM_SEQS": str(max(1024, max(args.stream_n))),
           "LOG_LEVEL": os.environ.get("LOG_LEVEL", "WARNING"), **(extra or {})}
    stack = start_stack(workdir, None, args.model, env, up_args)
    print(f"[stack] ready at {stack.url}", file=sys.stderr, flush=True)
    return stack


def api_pid(stack: Stack) -> int:
    pids = [p.pid for p in stack.by_role("api")]
    if len(pids) != 1:
        raise RuntimeError(f"expected one API process, found {pids}")
    return pids[0]


def redis_clients(stack: Stack) -> dict[str, int]:
    clients = stack.redis().client_list()
    return {"total": len(clients) - 1,  # less this connection
            "pubsub": sum(1 for c in clients if int(c.get("sub", 0)) or int(c.get("psub", 0)))}


class RssSampler(threading.Thread):
    def __init__(self, pid: int, period: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.proc, self.period = psutil.Process(pid), period
        self.peak = self.proc.memory_info().rss
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.period):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def now(self) -> int:
        return int(self.proc.memory_info().rss)

    def stop(self) -> None:
        self._halt.set()


def mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


# ----------------------------------------------------------------------------- (a) accept


async def _submit_loop(host: str, port: int, conns: int, duration: float, t_start: float,
                       auth: str = "") -> dict[str, Any]:
    req = (f"POST /v1/jobs HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{auth}"
           f"Content-Length: {len(SUBMIT_BODY)}\r\n\r\n").encode() + SUBMIT_BODY
    per_second: dict[int, int] = {}
    lat: list[float] = []
    statuses: dict[int, int] = {}
    errors = 0

    async def conn() -> None:
        nonlocal errors
        while time.time() < t_start:
            await asyncio.sleep(0.001)
        end = t_start + duration
        reader, writer = await asyncio.open_connection(host, port)
        try:
            while time.time() < end:
                t = time.perf_counter()
                writer.write(req)
                status = int((await reader.readline()).split()[1])
                length = 0
                while True:
                    line = await reader.readline()
                    if line in (b"\r\n", b""):
                        break
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                await reader.readexactly(length)
                now = time.time()
                if now <= end:
                    statuses[status] = statuses.get(status, 0) + 1
                    if status == 202:
                        per_second[int(now - t_start)] = per_second.get(int(now - t_start), 0) + 1
                        lat.append((time.perf_counter() - t) * 1e3)
        except (OSError, ValueError, IndexError, asyncio.IncompleteReadError):
            errors += 1
        finally:
            writer.close()

    await asyncio.gather(*(conn() for _ in range(conns)))
    return {"per_second": per_second, "lat": lat, "statuses": statuses, "errors": errors}


def _submit_proc(host: str, port: int, conns: int, duration: float, ready: Any, start_at: Any, out: Any,
                 auth: str = "") -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    with ready.get_lock():
        ready.value += 1
    while not start_at.value:
        time.sleep(0.005)
    out.put(asyncio.run(_submit_loop(host, port, conns, duration, start_at.value, auth)))


def accept_python(stack: Stack, procs: int, conns: int, duration: float, auth: str = "",
                  lead: float = 3.0) -> dict[str, Any]:
    """The client processes start together, `lead` s after they were spawned (or once all are ready, if later)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ready, start_at = ctx.Value("i", 0), ctx.Value("d", 0.0)
    spawned = time.time()
    ps = [ctx.Process(target=_submit_proc, args=("127.0.0.1", stack.port, conns, duration, ready, start_at, q,
                                                 auth))
          for _ in range(procs)]
    for p in ps:
        p.start()
    deadline = time.monotonic() + 120
    while ready.value < procs:
        if time.monotonic() > deadline or any(p.exitcode is not None for p in ps):
            for p in ps:
                p.kill()
            raise RuntimeError(f"only {ready.value}/{procs} accept client processes started")
        time.sleep(0.01)
    start_at.value = max(spawned + lead, time.time() + 0.05)
    results = [q.get(timeout=duration + 120) for _ in ps]
    for p in ps:
        p.join()
    per_second: dict[int, int] = {}
    statuses: dict[int, int] = {}
    lat: list[float] = []
    for r in results:
        for s, n in r["per_second"].items():
            per_second[s] = per_second.get(s, 0) + n
        for s, n in r["statuses"].items():
            statuses[s] = statuses.get(s, 0) + n
        lat += r["lat"]
    secs = [per_second.get(s, 0) for s in range(int(duration))]
    return {"client": f"python: {procs} processes x {conns} connections", "accepted_per_s": sum(secs) / len(secs),
            "per_second_median": statistics.median(secs), "per_second_min": min(secs),
            "lat_p50_ms": percentile(lat, 50), "lat_p99_ms": percentile(lat, 99), "statuses": statuses,
            "errors": sum(r["errors"] for r in results)}


WRK_LUA = """wrk.method = "POST"
wrk.body = '%s'
wrk.headers["Content-Type"] = "application/json"
""" % SUBMIT_BODY.decode()


def accept_wrk(stack: Stack, threads: int, conns: int, duration: float, workdir: Path) -> dict[str, Any] | None:
    wrk = shutil.which("wrk")
    if not wrk:
        print("[accept] wrk not installed (apt-get install -y wrk); skipping it", file=sys.stderr)
        return None
    script = workdir / "post.lua"
    script.write_text(WRK_LUA)
    cmd = [wrk, f"-t{threads}", f"-c{conns}", f"-d{int(duration)}s", "--latency", "-s", str(script),
           stack.url + "/v1/jobs"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 60).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    total = int(re.search(r"(\d+) requests in", out).group(1))
    errs = re.search(r"Socket errors: (.*)", out)

    def lat(q: str) -> float:
        m = re.search(rf"^\s+{q}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        if not m:
            return float("nan")
        return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]

    bad = int(non2xx.group(1)) if non2xx else 0
    return {"client": f"wrk: {threads} threads x {conns} connections",
            "accepted_per_s": rps * (total - bad) / total if total else 0.0, "requests": total, "non_2xx": bad,
            "lat_p50_ms": lat("50"), "lat_p99_ms": lat("99"), "socket_errors": errs.group(1) if errs else ""}


def drop_queued(stack: Stack) -> None:
    """After a paused-workers run: forget the jobs that piled up (nobody waits for them)."""
    from shared import names

    r = stack.redis()
    for p in names.partitions():
        # the dropped jobs leave the queue's count too, or admission would go on counting them as waiting
        r.incrby(names.dequeued_counter(p), r.xtrim(names.stream(names.JOBS, p), maxlen=0))


def redis_cpu_s(stack: Stack) -> float:
    """CPU seconds so far of the stack's redis-server processes (a cluster's masters and replicas)."""
    total = 0.0
    for p in stack.by_role("redis-server"):
        try:
            total += sum(p.cpu_times()[:2])
        except psutil.Error:
            continue
    return total


def run_accept(stack: Stack, args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    rows = []
    for mode in ("API + Redis alone (workers paused)", "whole stack (workers consuming)"):
        paused = mode.startswith("API")
        for client in ("python", "wrk"):
            if paused:
                stack.pause("tokenizer", "inference")
            try:
                if client == "python":
                    r = accept_python(stack, args.accept_procs, args.accept_conns, args.accept_s,
                                      lead=3.0 * args.pauses)
                else:
                    r = accept_wrk(stack, args.accept_procs, args.accept_procs * args.accept_conns, args.accept_s,
                                   workdir)
            finally:
                if paused:
                    drop_queued(stack)
                    stack.resume("tokenizer", "inference")
            if r is None:
                continue
            r["mode"] = mode
            rows.append(r)
            print(f"[accept] {mode}, {r['client']}: {r['accepted_per_s']:.0f} jobs/s accepted, "
                  f"p50 {r['lat_p50_ms']:.1f} ms, p99 {r['lat_p99_ms']:.1f} ms", file=sys.stderr, flush=True)
            time.sleep(args.settle * (3 if paused else 8) / 8)  # let the stack drain what it accepted
    return rows


def run_accept_auth(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    """The accept rate with keys and rate limits on against off: two stacks up at once, runs
    alternating between them (workers paused: the API and Redis alone), medians per side."""
    from shared import tenants

    big = {"MAX_QUEUED": str(10**9), "MAX_QUEUE_WAIT_S": str(10**9)}  # measure the checks, not a refusal
    stacks = {"auth off": start(args, workdir / "auth-off", {**big, "AUTH": "off"}),
              "auth + limits": start(args, workdir / "auth-on", {**big, "AUTH": "required"})}
    try:
        key, _ = tenants.create(stacks["auth + limits"].redis(), "bench", rpm=10**9, tpm=10**12, max_queued=10**9,
                                max_streams=10**9)
        auth = {"auth off": "", "auth + limits": f"Authorization: Bearer {key}\r\n"}
        rows: list[dict[str, Any]] = []
        for rnd in range(args.auth_rounds):
            order = list(stacks) if rnd % 2 == 0 else list(stacks)[::-1]
            for name in order:
                stack = stacks[name]
                stack.pause("tokenizer", "inference")
                try:
                    r = accept_python(stack, args.accept_procs, args.accept_conns, args.accept_s, auth[name],
                                      lead=3.0 * args.pauses)
                finally:
                    drop_queued(stack)
                    stack.resume("tokenizer", "inference")
                r.update(mode=name, round=rnd)
                rows.append(r)
                print(f"[accept-auth] round {rnd}, {name}: {r['accepted_per_s']:.0f} jobs/s, "
                      f"p50 {r['lat_p50_ms']:.1f} ms, statuses {r['statuses']}", file=sys.stderr, flush=True)
                time.sleep(2 * args.pauses)
    finally:
        for stack in stacks.values():
            stop_stack(stack)
    med = {name: statistics.median(r["accepted_per_s"] for r in rows if r["mode"] == name) for name in stacks}
    print(f"\naccept with keys and limits against without ({args.auth_rounds} alternating rounds of "
          f"{args.accept_s:.0f} s, workers paused, medians)\n")
    print("| stack | jobs/s accepted (median) | runs |\n|---|---|---|")
    for name in stacks:
        runs = ", ".join(f"{r['accepted_per_s']:.0f}" for r in rows if r["mode"] == name)
        print(f"| {name} | {med[name]:,.0f} | {runs} |")
    if med["auth off"]:
        print(f"\nratio (auth + limits / off): {med['auth + limits'] / med['auth off']:.2f}")
    return rows


def run_accept_cluster(args: argparse.Namespace, workdir: Path) -> dict[str, list[dict[str, Any]]]:
    """Accepted jobs/s and relayed events, one Redis node against a local 3-master cluster: both stacks
    up at once, rounds alternating; Redis CPU per operation (a cluster's replicas included)."""
    from shared import names

    big = {"MAX_QUEUED": str(10**9), "MAX_QUEUE_WAIT_S": str(10**9)}
    stacks = {"one node": start(args, workdir / "single", big),
              "3-master cluster": start(args, workdir / "cluster", big, ["--redis-cluster", "3"])}
    partitions = {"one node": 1, "3-master cluster": 12}  # each stack's REDIS_PARTITIONS (the supervisor's default)
    accept: list[dict[str, Any]] = []
    relay: list[dict[str, Any]] = []
    try:
        for rnd in range(args.auth_rounds):
            order = list(stacks) if rnd % 2 == 0 else list(stacks)[::-1]
            for name in order:
                stack = stacks[name]
                with names.partitions_as(partitions[name]):  # this process names keys for that stack
                    stack.pause("tokenizer", "inference")
                    cpu0 = redis_cpu_s(stack)
                    try:
                        r = accept_python(stack, args.accept_procs, args.accept_conns, args.accept_s,
                                          lead=3.0 * args.pauses)
                    finally:
                        r_cpu = redis_cpu_s(stack) - cpu0
                        drop_queued(stack)
                        stack.resume("tokenizer", "inference")
                    jobs = max(1.0, r["accepted_per_s"] * args.accept_s)
                    r.update(mode=name, round=rnd, redis_cpu_ms_per_job=r_cpu * 1e3 / jobs)
                    accept.append(r)
                    print(f"[accept-cluster] round {rnd}, {name}: {r['accepted_per_s']:.0f} jobs/s, p50 "
                          f"{r['lat_p50_ms']:.1f} ms, Redis {r['redis_cpu_ms_per_job']:.3f} CPU-ms/job, statuses "
                          f"{r['statuses']}", file=sys.stderr, flush=True)
                    for row in run_relay(stack, args):
                        row.update(mode=name, round=rnd)
                        relay.append(row)
                time.sleep(2 * args.pauses)
    finally:
        for stack in stacks.values():
            stop_stack(stack)

    def med(rows: list[dict[str, Any]], name: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["mode"] == name)

    print(f"\none Redis node against a 3-master cluster (3 replicas, 12 partitions) on {os.cpu_count()} CPUs; "
          f"{args.auth_rounds} alternating rounds, medians\n")
    print("| Redis | jobs/s accepted (workers paused) | accept p50 ms | Redis CPU-ms per job | "
          "relay delay p50 / p99 ms | Redis CPU-ms per event | API CPU-ms per event |\n|---|---|---|---|---|---|---|")
    for name in stacks:
        print(f"| {name} | {med(accept, name, 'accepted_per_s'):,.0f} | {med(accept, name, 'lat_p50_ms'):.1f} | "
              f"{med(accept, name, 'redis_cpu_ms_per_job'):.3f} | {med(relay, name, 'p50_ms'):.1f} / "
              f"{med(relay, name, 'p99_ms'):.1f} | {med(relay, name, 'redis_cpu_ms_per_event'):.4f} | "
              f"{med(relay, name, 'api_cpu_ms_per_event'):.4f} |")
    return {"accept": accept, "relay": relay}


# ----------------------------------------------------------------------------- SSE clients


async def _sse(url: str, job_id: str, rec: dict[str, Any], connected: Any, timeout: float) -> None:
    """One SSE stream on /v1/jobs/{id}/events (harness/sse.py's bare reader, one deadline for the
    whole stream, no timer per read: it shares the cores with the API it measures)."""
    told = False
    try:
        async with asyncio.timeout(timeout):
            for attempt in range(OPEN_ATTEMPTS):  # a 503 (Retry-After) is retried, as a client would
                try:
                    async with aclosing(raw_events(url, f"/v1/jobs/{job_id}/events")) as stream:
                        async for events in stream:
                            now = time.time()
                            for event, data in events:
                                if not data:
                                    continue
                                if not told:
                                    told = True
                                    with connected.get_lock():
                                        connected.value += 1
                                if event == b"token":
                                    msg = json.loads(data)
                                    seq = int(msg["seq"])
                                    if seq != rec["last_seq"] + 1:
                                        rec["gaps"] += 1
                                    rec["last_seq"] = seq
                                    rec["tokens"] += 1
                                    rec["text_len"] += len(msg["text"])
                                    if rec["stamped"]:
                                        rec["delays"].append((now - float(msg["text"])) * 1e3)
                                    elif rec["first_token"] is None:
                                        rec["first_token"] = now
                                elif event == b"done":
                                    rec["done"] = now
                                    return
                                elif event == b"error":
                                    rec["error"] = data.decode()[:200]
                                    return
                    rec["error"] = rec.get("error") or "closed before done"
                    return
                except HttpStatusError as exc:
                    rec["open_errors"].append(str(exc.status))
                    await asyncio.sleep(0.2 + 0.3 * attempt)
            rec["error"] = f"HTTP {rec['open_errors'][-1]} on all {OPEN_ATTEMPTS} attempts"
    except (TimeoutError, OSError, ValueError, asyncio.IncompleteReadError) as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        if not told:
            with connected.get_lock():
                connected.value += 1  # count it anyway so the run does not wait for it forever


def _sse_proc(port: int, job_ids: list[str], stamped: bool, connected: Any, timeout: float, out: Any) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    recs = [{"job": j, "open_errors": [], "tokens": 0, "text_len": 0, "last_seq": 0, "gaps": 0, "delays": [],
             "done": None, "first_token": None, "error": None, "stamped": stamped} for j in job_ids]

    async def main() -> None:
        url = f"http://127.0.0.1:{port}"
        await asyncio.gather(*(_sse(url, j, r, connected, timeout) for j, r in zip(job_ids, recs)))

    asyncio.run(main())
    out.put(recs)


class SseClients:
    """N SSE streams spread over P processes; `wait_connected` returns once each has its first event."""

    def __init__(self, port: int, job_ids: list[str], procs: int, stamped: bool, timeout: float) -> None:
        ctx = mp.get_context("spawn")
        self.n, self.q = len(job_ids), ctx.Queue()
        self.connected = ctx.Value("i", 0)
        shares = [job_ids[i::procs] for i in range(procs)]
        self.ps = [ctx.Process(target=_sse_proc, args=(port, s, stamped, self.connected, timeout, self.q))
                   for s in shares if s]
        for p in self.ps:
            p.start()

    def wait_connected(self, timeout: float) -> float:
        t0 = time.monotonic()
        while self.connected.value < self.n:
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"only {self.connected.value}/{self.n} streams opened in {timeout:.0f}s")
            time.sleep(0.05)
        return time.monotonic() - t0

    def results(self, timeout: float) -> list[dict[str, Any]]:
        recs: list[dict[str, Any]] = []
        for _ in self.ps:
            recs += self.q.get(timeout=timeout)
        for p in self.ps:
            p.join()
        return recs


# ----------------------------------------------------------------------------- (b) streams


def submit_jobs(stack: Stack, n: int, max_tokens: int) -> list[str]:
    import httpx

    async def go() -> list[str]:
        async with httpx.AsyncClient(base_url=stack.url, timeout=60,
                                     limits=httpx.Limits(max_connections=32)) as c:
            sem = asyncio.Semaphore(32)

            async def one() -> str:
                async with sem:
                    r = await c.post("/v1/jobs", json={"prompt": "Hello", "max_tokens": max_tokens})
                    r.raise_for_status()
                    return r.json()["id"]

            return list(await asyncio.gather(*(one() for _ in range(n))))

    return asyncio.run(go())


def run_streams(stack: Stack, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    api = api_pid(stack)
    for n in args.stream_n:
        base = redis_clients(stack)
        sampler = RssSampler(api)
        rss_idle = sampler.now()
        stack.pause("inference")  # the jobs wait until every stream is open
        try:
            ids = submit_jobs(stack, n, args.stream_tokens)
            clients = SseClients(stack.port, ids, args.client_procs, stamped=False, timeout=args.stream_timeout)
            open_s = clients.wait_connected(120)
            time.sleep(1.0 * args.pauses)
            rss_held = sampler.now()
            held = redis_clients(stack)
            sampler.start()
        finally:
            stack.resume("inference")
        t0 = time.time()
        recs = clients.results(args.stream_timeout + 60)
        sampler.stop()
        sampler.join()
        with urllib.request.urlopen(f"{stack.url}/v1/jobs/{ids[0]}", timeout=30) as resp:
            job = json.load(resp)  # every job has the same text: the synthetic token, max_tokens times
        text_len = len(job["text"]) if job["usage"]["completion_tokens"] == args.stream_tokens else -1
        ok = [r for r in recs if r["error"] is None and r["done"] is not None and r["gaps"] == 0
              and r["tokens"] >= 1 and r["text_len"] == text_len]
        open_503 = sum(len(r["open_errors"]) for r in recs)
        events = sum(r["tokens"] for r in recs)
        last_done = max((r["done"] for r in recs if r["done"]), default=t0)
        errors = [r["error"] for r in recs if r["error"]]
        row = {"streams": n, "complete": len(ok), "open_s": open_s, "rss_idle": rss_idle, "rss_held": rss_held,
               "rss_peak": sampler.peak, "redis_clients_before": base, "redis_clients_held": held,
               "token_events": events, "tokens_expected": n * args.stream_tokens,
               "events_per_s": events / max(1e-9, last_done - t0), "burst_s": last_done - t0,
               "first_error": errors[0] if errors else None, "open_refusals": open_503}
        rows.append(row)
        print(f"[streams] {n}: {len(ok)}/{n} complete, opened in {open_s:.1f}s, RSS {mib(rss_idle)} idle -> "
              f"{mib(rss_held)} held -> {mib(sampler.peak)} peak, redis clients {base['total']} -> "
              f"{held['total']} ({held['pubsub']} pub/sub), {events} token events in {last_done - t0:.1f}s, "
              f"{open_503} refused opens (retried)" + (f"; first error: {errors[0]}" if errors else ""),
              file=sys.stderr, flush=True)
        time.sleep(2 * args.pauses)
    return rows


# ----------------------------------------------------------------------------- (c) relay delay


def make_records(stack: Stack, n: int) -> list[str]:
    from shared import names
    from shared.jobs import new_record
    from shared.settings import DEFAULT_MODEL_NAME

    ids = [f"job_bench{os.getpid()}{time.time_ns()}{i}" for i in range(n)]
    pipe = stack.redis().pipeline(transaction=False)
    for job_id in ids:
        rec = new_record(job_id, DEFAULT_MODEL_NAME, '{"prompt": "bench"}')
        rec.update(status="running", started_at=repr(time.time()))
        pipe.hset(names.job_key(job_id), mapping=rec)
        pipe.expire(names.job_key(job_id), 3600)
    pipe.execute()
    return ids


def publish(stack: Stack, ids: list[str], ticks: int, interval: float, batch: int = 0) -> float:
    """Every stream gets one token event per interval, written as the output lane writes a step
    (gpu_worker/output_lane.py: `step_write` per job, one `JobOps.step` call, in one MULTI/EXEC).
    batch 0: all streams in one step per tick, the worst case (one burst of N events). batch B:
    groups of B streams, one step each, spread evenly over the interval, like N/B inference workers
    each stepping B sequences. Returns how far behind schedule the publisher fell at worst (s)."""
    from shared import names
    from shared.events import token_message
    from shared.job_ops import JobOps, step_write
    from shared.redis_client import CLUSTER_TYPES

    client = stack.redis()
    cluster = isinstance(client, CLUSTER_TYPES)
    ops = JobOps(client, 3600)
    groups = [ids[i:i + batch] for i in range(0, len(ids), batch)] if batch else [ids]
    seqs = dict.fromkeys(ids, 0)
    text_bytes = dict.fromkeys(ids, 0)
    token = (100).to_bytes(4, "little")  # one packed token id per event
    t0 = time.monotonic()
    behind = 0.0
    for k in range(ticks):
        for g, group in enumerate(groups):
            target = t0 + k * interval + g * interval / len(groups)
            delay = target - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            behind = max(behind, -delay)
            pipe = client.pipeline(transaction=not cluster)  # as the output lane: one step call per partition
            stamp = repr(time.time())
            chunk = stamp.encode()
            steps: dict[int, tuple[list[str], list[Any]]] = {}
            for job_id in group:
                keys, args = steps.setdefault(names.job_partition(job_id), ([], []))
                seqs[job_id] += 1
                seq = seqs[job_id]
                message = token_message(seq, stamp, [])
                job_keys, job_args = step_write(job_id, 3 if seq == 1 else 0, (seq - 1) * 4, token,
                                                text_bytes[job_id], chunk, seq, message, seq)
                text_bytes[job_id] += len(chunk)
                keys += job_keys
                args += job_args
            for keys, args in steps.values():
                ops.step(keys, args, pipe)
            pipe.execute()
    return behind


def finish_records(stack: Stack, ids: list[str]) -> None:
    from shared.job_ops import JobOps
    from shared.jobs import FinishReason

    client = stack.redis()
    ops = JobOps(client, 3600)
    pipe = client.pipeline(transaction=False)
    for job_id in ids:
        ops.finish(job_id, FinishReason.length, "", {"text": ""}, pipe=pipe)
    pipe.execute()


def run_relay(stack: Stack, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    api = api_pid(stack)
    for n in args.relay_n:
        ids = make_records(stack, n)
        sampler = RssSampler(api)
        clients = SseClients(stack.port, ids, args.client_procs if n > 1 else 1, stamped=True,
                             timeout=args.relay_ticks * args.relay_interval + 120)
        clients.wait_connected(120)
        time.sleep(0.5 * args.pauses)
        sampler.start()
        api_proc = psutil.Process(api)
        cpu0, redis0 = sum(api_proc.cpu_times()[:2]), redis_cpu_s(stack)
        behind = publish(stack, ids, args.relay_ticks, args.relay_interval, args.relay_batch)
        finish_records(stack, ids)
        recs = clients.results(args.relay_ticks * args.relay_interval + 180)
        api_cpu_s = sum(api_proc.cpu_times()[:2]) - cpu0
        redis_s = redis_cpu_s(stack) - redis0
        sampler.stop()
        sampler.join()
        delays = [d for r in recs for d in r["delays"]]
        complete = sum(1 for r in recs if r["error"] is None and r["done"] and r["tokens"] == args.relay_ticks
                       and r["gaps"] == 0)
        rate = n / args.relay_interval
        row = {"streams": n, "batch": args.relay_batch or n, "events_per_s_offered": rate, "events": len(delays),
               "events_expected": n * args.relay_ticks, "complete": complete, "p50_ms": percentile(delays, 50),
               "p99_ms": percentile(delays, 99), "max_ms": max(delays) if delays else float("nan"),
               "publisher_behind_s": behind, "rss_peak": sampler.peak,
               "open_refusals": sum(len(r["open_errors"]) for r in recs),
               "api_cpu_ms_per_event": api_cpu_s * 1e3 / max(1, len(delays)),
               "redis_cpu_ms_per_event": redis_s * 1e3 / max(1, len(delays))}
        rows.append(row)
        print(f"[relay] {n} streams at {rate:.0f} events/s, bursts of {args.relay_batch or n}: delay p50 "
              f"{row['p50_ms']:.1f} ms, p99 "
              f"{row['p99_ms']:.1f} ms, max {row['max_ms']:.1f} ms; API {row['api_cpu_ms_per_event']:.3f} CPU-ms "
              f"per event; {complete}/{n} complete; publisher up to "
              f"{behind * 1e3:.0f} ms behind", file=sys.stderr, flush=True)
        time.sleep(1 * args.pauses)
    return rows


# ----------------------------------------------------------------------------- report


def report(accept: list[dict[str, Any]], streams: list[dict[str, Any]], relay: list[dict[str, Any]],
           args: argparse.Namespace) -> None:
    print(f"\nOne API process, ENGINE=synthetic, {os.cpu_count()} CPUs shared by clients, API, Redis and workers.\n")
    if accept:
        print(f"(a) `POST /v1/jobs` accepted (202) per second, {args.accept_s:.0f} s per row (target >= 1,000)\n")
        print("| stack | client | jobs/s accepted | latency p50 ms | latency p99 ms | non-202 |")
        print("|---|---|---|---|---|---|")
        for r in accept:
            bad = r.get("non_2xx", sum(n for s, n in r.get("statuses", {}).items() if s != 202))
            print(f"| {r['mode']} | {r['client']} | {r['accepted_per_s']:,.0f} | {r['lat_p50_ms']:.1f} | "
                  f"{r['lat_p99_ms']:.1f} | {bad} |")
        print()
    if streams:
        print(f"(b) concurrent SSE streams, one per job, {args.stream_tokens} tokens each, {args.client_procs} client "
              "processes (target >= 1,000)\n")
        print("| streams | complete (all tokens, in order, + done) | API RSS idle | RSS, N held | RSS peak | "
              "Redis connections before / held (pub/sub) | token events/s delivered | opens refused (503, retried) |")
        print("|---|---|---|---|---|---|---|---|")
        for r in streams:
            print(f"| {r['streams']} | {r['complete']}/{r['streams']} | {mib(r['rss_idle'])} | {mib(r['rss_held'])} | "
                  f"{mib(r['rss_peak'])} | {r['redis_clients_before']['total']} / {r['redis_clients_held']['total']} "
                  f"({r['redis_clients_held']['pubsub']}) | {r['events_per_s']:,.0f} | {r['open_refusals']} |")
        print()
    if relay:
        print(f"(c) relay delay, the output lane's step write (STEP script in MULTI) -> SSE client, one token per "
              f"stream every {args.relay_interval * 1e3:.0f} ms for {args.relay_ticks} ticks "
              "(target p99 <= 50 ms)\n")
        print("| streams | events per burst | events/s offered | delay p50 ms | delay p99 ms | delay max ms | "
              "complete | API RSS peak | opens refused (503, retried) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in relay:
            print(f"| {r['streams']} | {r['batch']} | {r['events_per_s_offered']:,.0f} | {r['p50_ms']:.1f} | "
                  f"{r['p99_ms']:.1f} | "
                  f"{r['max_ms']:.1f} | {r['complete']}/{r['streams']} | {mib(r['rss_peak'])} | {r['open_refusals']} |")
        print()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="accept,streams,relay",
                   help="comma list of accept, streams, relay; or accept-auth (keys and limits on against off), or "
                        "accept-cluster (one Redis node against a 3-master cluster)")
    p.add_argument("--auth-rounds", type=int, default=3, help="alternating rounds for accept-auth")
    p.add_argument("--quick", action="store_true", help="seconds: every part once, 1 s accept runs from one client "
                   "process, 4 streams of 3 tokens, 4 relay streams of 3 ticks, no pauses")
    p.add_argument("--model", default=None,
                   help="model directory (the synthetic engine needs only its tokenizer; default: the service's)")
    p.add_argument("--accept-s", type=float, default=10.0, help="seconds per accept run")
    p.add_argument("--accept-procs", type=int, default=2, help="client processes (and wrk threads)")
    p.add_argument("--accept-conns", type=int, default=32, help="connections per client process")
    p.add_argument("--client-procs", type=int, default=2, help="SSE client processes for streams and relay")
    p.add_argument("--stream-n", default="100,500,1000")
    p.add_argument("--stream-tokens", type=int, default=200)
    p.add_argument("--stream-timeout", type=float, default=300.0)
    p.add_argument("--relay-n", default="1,100,1000")
    p.add_argument("--relay-ticks", type=int, default=50)
    p.add_argument("--relay-interval", type=float, default=0.1, help="seconds between a stream's token events")
    p.add_argument("--relay-batch", type=int, default=0,
                   help="streams per MULTI, spread over the interval (0: all streams in one burst per tick)")
    p.add_argument("--settle", type=float, default=8.0, help="seconds for the stack to drain after an accept run")
    p.add_argument("--pauses", type=float, default=1.0,
                   help="scale of the fixed pauses: before an accept run (3 s), after opening streams, between runs")
    p.add_argument("--json", dest="json_out")
    args = p.parse_args(argv)
    if args.quick:
        args.accept_s, args.accept_procs, args.accept_conns, args.settle, args.pauses = 1.0, 1, 4, 0.0, 0.0
        args.stream_n, args.stream_tokens, args.client_procs, args.auth_rounds = "4", 3, 1, 1
        args.relay_n, args.relay_ticks, args.relay_interval = "4", 3, 0.02
    args.model = args.model or default_model()
    args.stream_n = [int(x) for x in str(args.stream_n).split(",")]
    args.relay_n = [int(x) for x in str(args.relay_n).split(",")]
    only = set(args.only.split(","))

    workdir = Path(tempfile.mkdtemp(prefix="conveyor-plumbing-"))
    if only == {"accept-auth"}:
        rows = run_accept_auth(args, workdir)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps({"accept_auth": rows}, indent=2, default=str))
        return 0
    if only == {"accept-cluster"}:
        both = run_accept_cluster(args, workdir)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps({"accept_cluster": both}, indent=2, default=str))
        return 0
    # measure the plumbing, not admission: with inference paused for the streams, the queue cap (the measured drain
    # rate times MAX_QUEUE_WAIT_S) can fall below the jobs a round submits, and they would answer 429
    stack = start(args, workdir / "stack", {"MAX_QUEUED": str(10**9), "MAX_QUEUE_WAIT_S": str(10**9)})
    accept: list[dict[str, Any]] = []
    streams: list[dict[str, Any]] = []
    relay: list[dict[str, Any]] = []
    try:
        if "accept" in only:
            accept = run_accept(stack, args, workdir)
        if "streams" in only:
            streams = run_streams(stack, args)
        if "relay" in only:
            relay = run_relay(stack, args)
    finally:
        print("[stack] stopping", file=sys.stderr, flush=True)
        stop_stack(stack)
    report(accept, streams, relay, args)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()},
                                                   "accept": accept, "streams": streams, "relay": relay},
                                                  indent=2, default=str))
    return 0
