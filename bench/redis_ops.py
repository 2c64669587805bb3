"""What conveyor's Redis traffic costs Redis, measured on a real redis-server started here.

    .venv/bin/python -m bench serve redis                          # embedded redis-server 6.2, ~1.5 min
    .venv/bin/python -m bench serve redis --server /usr/bin/redis-server --seconds 5
    .venv/bin/python -m bench serve redis --quick                  # seconds: every scenario, briefly

Every scenario replays the commands the code sends (key names from shared.names, the Lua scripts
from shared.jobs and shared.job_ops) with append-only persistence on (everysec), as `conveyor up`
runs Redis, except that automatic AOF rewrites are off so the bytes appended can be counted. Client
processes drive it for --seconds; the figure that matters is Redis's own main-thread CPU time
(INFO cpu), because a Python client on this machine cannot saturate Redis: commands (or jobs) per
Redis CPU-second is what one Redis core sustains once Redis is the bottleneck.

Scenarios:
- xadd-300B:  XADD of a ~300-byte entry to the jobs stream (depth 1: one command per round trip;
              depth 64: pipelined)
- publish:    PUBLISH of a ~80-byte chunk to a per-job channel, one pattern subscriber reading
- chunk-step: one output-lane step for 32 running jobs: MULTI, STEP_SCRIPT (per job SETRANGE
              tokens + SETRANGE text + XADD event + PUBLISH + HSET seq/completion_tokens), EXEC
- job:        a job's whole life in waves of 32 concurrent jobs of --tokens tokens: submit
              (SUBMIT script), tokenizer (XREADGROUP, HMGET, FAIR_PUSH script: the jobs into the fair
              queue, the entries acknowledged), inference (FAIR_POP script: each job onto the tokenized
              stream and read, START script, one chunk-step per token, FINISH script, XACK per job);
              `job/4` and `job/8` stream one chunk per 4 or 8 tokens instead of one per token
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from infra.redis_server import RedisServer, redis_binary
from shared import fair_queue, names, scripts
from shared.fair_queue import FairQueue
from shared.job_ops import JobOps, step_write, submit_write
from shared.jobs import FinishReason, new_record

REQUEST = '{"messages":[{"role":"user","content":"' + "x" * 200 + '"}],"max_tokens":256,"temperature":0.7}'
BATCH = 32
Step = Callable[[redis.Redis, int], int]  # (client, iteration) -> units done (commands, chunks or jobs)


def xadd(depth: int) -> Step:
    def step(r: redis.Redis, i: int) -> int:
        pipe = r.pipeline(transaction=False)
        for k in range(depth):
            pipe.xadd(names.stream(names.JOBS, 0), {"job_id": f"{os.getpid()}-{i}-{k}", "request": REQUEST},
                      maxlen=100_000, approximate=True)
        pipe.execute()
        return depth
    return step


def publish(depth: int) -> Step:
    def step(r: redis.Redis, i: int) -> int:
        pipe = r.pipeline(transaction=False)
        for k in range(depth):
            body = f'{{"seq":{i},"type":"token","text":" word"}}'
            pipe.publish(names.job_channel(f"{os.getpid()}-{k}"), body + " " * (80 - len(body)))
        pipe.execute()
        return depth
    return step


_OPS: dict[int, JobOps] = {}


def _ops(r: redis.Redis) -> JobOps:
    """One JobOps per client, as the output lane keeps one: a new one loads the scripts (SCRIPT LOAD, which
    the AOF records with their source) before its first call."""
    return _OPS.setdefault(id(r), JobOps(r, 86400))


def chunk_step(r: redis.Redis, jobs: list[str], seq: int, per_chunk: int = 1, finish: JobOps | None = None,
               worker: str = "") -> None:
    """One output-lane step (gpu_worker/output_lane.py): in one MULTI/EXEC, one STEP_SCRIPT call
    with every job's chunk `seq` of `per_chunk` tokens, as `worker` (the one the jobs' records name);
    with `finish`, each job then ends in it."""
    ops = finish or _ops(r)
    pipe = r.pipeline(transaction=True)
    n = seq * per_chunk
    piece = b"tok " * per_chunk
    keys: list[str] = []
    args: list[Any] = []
    for job_id in jobs:
        job_keys, job_args = step_write(job_id, 3 if seq == 1 else 0, (n - per_chunk) * 4,
                                        b"\x01\x02\x03\x04" * per_chunk, (seq - 1) * len(piece), piece, seq,
                                        b'{"seq":%d,"type":"token","text":"%s"}' % (seq, piece), n, worker=worker)
        keys += job_keys
        args += job_args
    ops.step(keys, args, pipe)
    if finish is not None:
        for job_id in jobs:
            finish.finish(job_id, FinishReason.length, "", {"completion_tokens": n}, pipe=pipe, worker=worker)
    pipe.execute()


def chunk(r: redis.Redis, i: int) -> int:
    """Steps of BATCH jobs of 256 tokens each; returns the chunks written."""
    jobs = [f"{os.getpid()}-{i // 256}-{k}" for k in range(BATCH)]
    if i % 256 == 0:  # running records to write into (step.lua writes nothing into a job that does not exist)
        pipe = r.pipeline(transaction=False)
        for job_id in jobs:
            pipe.hset(names.job_key(job_id), mapping=new_record(job_id, "m", "{}") | {"status": "running"})
        pipe.execute()
    chunk_step(r, jobs, i % 256 + 1)
    return BATCH


def job(tokens: int, every: int) -> Step:
    """A wave of BATCH jobs through every stage; returns the jobs finished (not commands)."""
    state: dict[str, Any] = {}

    def step(r: redis.Redis, wave: int) -> int:
        if not state:
            for stream, group in names.stream_groups().items():
                with contextlib.suppress(redis.ResponseError):  # the group exists
                    r.xgroup_create(stream, group, id="0", mkstream=True)
            state["jobs"], state["submit"] = _ops(r), r.register_script(scripts.SUBMIT.source)
        jobs: JobOps = state["jobs"]
        consumer = f"bench-{os.getpid()}"
        ids = [f"{os.getpid()}-{wave}-{k}" for k in range(BATCH)]
        for job_id in ids:  # api/store.py: one script call per request
            keys, args = submit_write(job_id, new_record(job_id, "m", REQUEST), REQUEST, 86400)
            state["submit"](keys=keys, args=args)
        # workers/tokenizer/worker.py
        reply: Any = r.xreadgroup(names.TOKENIZER_GROUP, consumer, {names.stream(names.JOBS, 0): ">"}, count=BATCH)
        entries = reply[0][1]
        pipe = r.pipeline(transaction=False)
        for job_id in ids:
            pipe.hmget(names.job_key(job_id), "status", "cancel_requested")
        pipe.execute()
        # one row per job (45 prompt tokens: ~180 bytes of ids and ~500 of Arrow framing) into the fair queue
        fair_queue.push(r, 0, [e[0] for e in entries], [(job_id, 0, 45, os.urandom(680)) for job_id in ids])
        # gpu_worker/worker.py reader lane (the fair queue's pop: each job onto the tokenized stream and read),
        # then output lane steps; each job's entry is acknowledged once it ends
        taken = FairQueue(r, consumer).pop(BATCH, None)
        assert len(taken) == BATCH, len(taken)
        for job_id in ids:
            jobs.start(job_id, consumer)
        chunks = -(-tokens // every)
        for seq in range(1, chunks + 1):
            chunk_step(r, ids, seq, every, jobs if seq == chunks else None, consumer)
        pipe = r.pipeline(transaction=False)
        for entry in taken:
            pipe.xack(entry.stream, names.INFERENCE_GROUP, entry.id)
        pipe.execute()
        return BATCH

    return step


def drive(url: str, step: Step, seconds: float, go: Any, out: Any) -> None:
    r = redis.Redis.from_url(url)
    go.wait()
    done, i, deadline = 0, 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        done += step(r, i)
        i += 1
    out.put(done)


def subscribe(url: str, ready: Any, stop: Any, out: Any) -> None:
    """One pattern subscriber reading every chunk, as an API process's relay connection would."""
    client: Any = redis.Redis.from_url(url)
    p = client.pubsub(ignore_subscribe_messages=True)
    p.psubscribe(names.job_channel("*"))
    ready.set()
    n, dropped = 0, False
    try:
        while not stop.is_set():
            if p.get_message(timeout=0.2):
                n += 1
    except redis.ConnectionError:
        dropped = True  # it fell behind past client-output-buffer-limit pubsub: Redis closed it
    out.put((n, dropped))


def cpu(r: redis.Redis) -> tuple[float, float]:
    info = r.info("cpu")
    main = info.get("used_cpu_sys_main_thread", info["used_cpu_sys"]) + \
        info.get("used_cpu_user_main_thread", info["used_cpu_user"])
    return float(main), float(info["used_cpu_sys"] + info["used_cpu_user"])


def measure(url: str, name: str, step: Step, seconds: float, clients: int, settle: float = 0.5) -> dict[str, Any]:
    r = redis.Redis.from_url(url)
    r.flushdb()
    r.config_set("auto-aof-rewrite-percentage", 0)  # a rewrite mid-run would hide the bytes appended
    r.config_resetstat()
    baseline = r.info("memory")["used_memory"]
    aof0 = r.info("persistence")["aof_current_size"]
    ctx = mp.get_context("fork")
    go, ready, stop, out, sub_out = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue(), ctx.Queue()
    sub = ctx.Process(target=subscribe, args=(url, ready, stop, sub_out))
    sub.start()
    ready.wait(10)
    procs = [ctx.Process(target=drive, args=(url, step, seconds, go, out)) for _ in range(clients)]
    for p in procs:
        p.start()
    time.sleep(settle)  # the clients reach go.wait() before the CPU baseline is read
    cpu0, t0 = cpu(r), time.monotonic()
    go.set()
    units = sum(out.get(timeout=seconds + 120) for _ in procs)
    wall, cpu1 = time.monotonic() - t0, cpu(r)
    stop.set()
    received, dropped = sub_out.get(timeout=30)
    for p in [*procs, sub]:
        p.join()
    stats = r.info("commandstats")
    commands = sum(v["calls"] for k, v in stats.items() if k not in ("cmdstat_info", "cmdstat_config"))
    usec = sum(v["usec"] for k, v in stats.items() if k not in ("cmdstat_info", "cmdstat_config"))
    main_cpu, total_cpu = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]
    memory = r.info("memory")["used_memory"] - baseline
    aof = r.info("persistence")["aof_current_size"] - aof0
    return {"name": name, "units": units, "wall": wall, "commands": commands, "usec": usec,
            "main_cpu": main_cpu, "total_cpu": total_cpu, "received": received, "dropped": dropped,
            "memory": memory, "aof": aof}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", default="", help="redis-server binary (default: the embedded one)")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--clients", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=256, help="output tokens per job in the job scenarios")
    parser.add_argument("--only", default="", help="comma-separated scenario names")
    parser.add_argument("--settle", type=float, default=0.5,
                        help="seconds between starting the client processes and the measured run")
    parser.add_argument("--quick", action="store_true",
                        help="seconds: every scenario for 0.2 s after 0.05 s to settle, 8-token jobs")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.settle, args.tokens = 0.2, 0.05, 8

    binary = args.server or redis_binary()

    class Server(RedisServer):
        def command(self) -> list[str]:
            return [binary, *super().command()[1:]]

    scenarios: list[tuple[str, Step, str]] = [
        ("xadd-300B depth 1", xadd(1), "cmd"),
        ("xadd-300B depth 64", xadd(64), "cmd"),
        ("publish depth 1", publish(1), "cmd"),
        ("publish depth 64", publish(64), "cmd"),
        (f"chunk-step x{BATCH}", chunk, "chunk"),
        (f"job ({args.tokens} tok, chunk/token)", job(args.tokens, 1), "job"),
        (f"job/4 ({args.tokens} tok, chunk/4 tok: STREAM_INTERVAL 4)", job(args.tokens, 4), "job"),
        (f"job/8 ({args.tokens} tok, chunk/8 tok)", job(args.tokens, 8), "job"),
    ]
    if args.only:
        wanted = args.only.split(",")
        scenarios = [s for s in scenarios if any(s[0].startswith(w) for w in wanted)]
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(Path(tmp))
        url = server.start()
        version = redis.Redis.from_url(url).info("server")["redis_version"]
        print(f"redis-server {version} ({binary}), appendonly everysec, {os.cpu_count()} CPUs, "
              f"{args.clients} client process(es), {args.seconds:g} s per scenario\n")
        print("| scenario | client rate | Redis cmds/s | Redis main-thread CPU | µs Redis CPU per cmd "
              "| cmds per Redis CPU-s | jobs per Redis CPU-s | pub/sub msgs received |")
        print("|---|---|---|---|---|---|---|---|")
        try:
            for name, step, unit in scenarios:
                m = measure(url, name, step, args.seconds, args.clients, args.settle)
                per_cpu = m["commands"] / m["main_cpu"]
                rate = f"{m['units'] / m['wall']:,.0f} {unit}s/s"
                jobs = f"{m['units'] / m['main_cpu']:,.0f}" if unit == "job" else ""
                received = f"{m['received'] / m['wall']:,.0f}/s" + (" (dropped)" if m["dropped"] else "")
                print(f"| {name} | {rate} | {m['commands'] / m['wall']:,.0f} | {m['main_cpu'] / m['wall']:.0%} "
                      f"| {1e6 * m['main_cpu'] / m['commands']:.2f} | {per_cpu:,.0f} | {jobs} | {received} |",
                      flush=True)
                if unit == "job":
                    print(f"|  ↳ per job: {m['commands'] / m['units']:.0f} Redis commands (scripts count "
                          f"their inner calls), {m['memory'] / m['units'] / 1024:.1f} KiB kept, "
                          f"{m['aof'] / m['units'] / 1024:.0f} KiB appended to the AOF |||||||",
                          flush=True)
        finally:
            server.stop()
