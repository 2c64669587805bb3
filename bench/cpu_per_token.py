"""Serving under guidellm, conveyor against vLLM-CPU, with the CPU each process spends per 1,000 tokens.

Both servers run on this machine (conveyor via harness/stack.py, vLLM via `vllm serve` from the venv
bench/vllm_setup.sh makes), each alone while measured: the same guidellm load (concurrent streams,
synthetic prompts of --prompt-tokens, --output-tokens each, --seconds per run) goes to one, then the
other, alternating which goes first, --repeats times per level. Per run it reads guidellm's JSON
(TTFT and ITL medians, the run's duration), the tokens the server generated meanwhile (its own
`generation_tokens_total`: guidellm's tok/s counts completed requests only) and each process's CPU
seconds from /proc/<pid>/stat, plus every thread of the model process (/proc/<pid>/task/*/stat:
conveyor's inference worker, vLLM's `VLLM::Worker`), divided by the tokens the run generated; and the
CPU of guidellm itself, which shares the cores.

    .venv/bin/python -m bench vllm serving --levels 1,8,32 --repeats 3
    .venv/bin/python -m bench vllm serving --servers conveyor,conveyor-traced --dtype auto --levels 32   # traces
    .venv/bin/python -m bench vllm serving --servers conveyor,conveyor-unbound,vllm --levels 32   # binding
    .venv/bin/python -m bench vllm serving --servers conveyor,conveyor-split,conveyor-batch --levels 32   # layouts
    .venv/bin/python -m bench vllm serving --servers conveyor,conveyor-onednn --levels 32   # the packed GEMM
    .venv/bin/python -m bench vllm serving --servers conveyor,conveyor@38f5d50 --levels 32   # against a revision
    .venv/bin/python -m bench vllm serving --servers conveyor,conveyor+GOMP_SPINCOUNT=0 --levels 32   # a setting
    .venv/bin/python -m bench vllm serving --quick      # seconds: a tiny model, conveyor only, one run of
                                                         # 1 stream for 4 s or 8 requests, 4 tokens per request,
                                                         # no warm-up, guidellm making 8 prompts ahead (not 4,096)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from bench.common import chosen_model
from harness.stack import ROOT, start_stack, stop_stack

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int, task: int | None = None) -> float:
    """User + system CPU seconds of a process (or one of its threads)."""
    path = f"/proc/{pid}/stat" if task is None else f"/proc/{pid}/task/{task}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def thread_times(pid: int) -> dict[str, float]:
    """CPU seconds per thread name (threads of one name summed)."""
    out: dict[str, float] = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{task}/comm").read_text().strip()
            out[name] = out.get(name, 0.0) + cpu_s(pid, int(task))
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


def snapshot(procs: dict[str, list[psutil.Process]], model_pid: int) -> dict:
    per_role = {}
    for role, ps in procs.items():
        total = 0.0
        for p in ps:
            try:
                total += cpu_s(p.pid)
            except (FileNotFoundError, ProcessLookupError):
                pass
        per_role[role] = total
    return {"roles": per_role, "threads": thread_times(model_pid)}


def diff(a: dict, b: dict, tokens: int) -> dict:
    k = 1000.0 / max(tokens, 1)
    roles = {r: round((b["roles"][r] - a["roles"].get(r, 0.0)) * k, 3) for r in b["roles"]}
    threads = {t: round((b["threads"][t] - a["threads"].get(t, 0.0)) * k, 3) for t in b["threads"]}
    return {"roles": roles, "threads": {t: v for t, v in threads.items() if v > 0.005}}


def guidellm(url: str, model_dir: str, streams: int, seconds: float, prompt_tokens: int, output_tokens: int,
             workdir: Path, model_name: str | None = None, prefetch: int = 0, max_requests: int = 0) -> dict:
    """One guidellm run of `seconds`, or of `max_requests` requests if they end sooner. `prefetch`: prompts its
    data-loader worker makes ahead (0: guidellm's default, 4,096). The run is stopped, with its worker processes,
    if it has not ended `seconds` + 180 s later (guidellm can hang at the end of a run: vllm-project/guidellm#431)."""
    out = workdir / f"guidellm-{time.monotonic_ns()}.json"
    backend = f"kind=openai_http,target={url}" + (f",model={model_name}" if model_name else "")
    cmd = [str(Path(sys.executable).parent / "guidellm"), "run", "--backend", backend,
           "--profile", f"kind=concurrent,streams={streams}", "--constraint", f"kind=max_duration,seconds={seconds}",
           "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
           "--tokenizer", f"kind=huggingface_auto,model={model_dir}",
           "--output", f"kind=json,path={out}", "--disable-console-interactive"]
    if prefetch:
        cmd += ["--data-loader", f"kind=pytorch,prefetch_factor={prefetch}"]
    if max_requests:
        cmd += ["--constraint", f"kind=max_requests,count={max_requests}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=workdir,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=seconds + 180)
    except BaseException as exc:
        os.killpg(proc.pid, signal.SIGKILL)  # its worker processes too: they hold the output pipe open
        proc.wait()
        if isinstance(exc, subprocess.TimeoutExpired):
            raise SystemExit(f"guidellm did not end within {seconds + 180:.0f} s; stopped it") from None
        raise
    if proc.returncode:
        raise SystemExit(f"guidellm failed:\n{output[-3000:]}")
    bench = json.loads(out.read_text())["benchmarks"][0]
    m = bench["metrics"]

    def med(name: str) -> float:
        return float(m[name]["successful"]["median"])

    return {"duration": float(bench["duration"]),
            "tok_s_completed": float(m["output_tokens_per_second"]["successful"]["mean"]),
            "ttft_ms": med("time_to_first_token_ms"), "itl_ms": med("inter_token_latency_ms"),
            "requests": int(m["request_totals"]["successful"]), "errored": int(m["request_totals"]["errored"])}


def generated_tokens(url: str, prefix: str) -> float:
    import httpx

    text = httpx.get(url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(f"{prefix}generation_tokens_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


class Conveyor:
    name, metric_prefix = "conveyor", "conveyor:"

    def __init__(self, model: str, dtype: str, workdir: Path, env: dict[str, str] | None = None) -> None:
        self.stack = start_stack(workdir, None, model, {"DTYPE": dtype, "LOG_LEVEL": "WARNING", **(env or {})},
                                 timeout=600)
        self.url = self.stack.url

    def processes(self) -> tuple[dict[str, list[psutil.Process]], int]:
        procs: dict[str, list[psutil.Process]] = {}
        for role, p in self.stack.tree():
            procs.setdefault(role, []).append(p)
        return procs, procs["inference"][0].pid

    def each_thread(self, apply: Callable[[str, int], object]) -> None:
        """apply(role, thread id) to every thread of the stack's processes (threads started later inherit)."""
        for role, p in self.stack.tree():
            for task in os.listdir(f"/proc/{p.pid}/task"):
                apply(role, int(task))

    def stop(self) -> None:
        stop_stack(self.stack)


class TracedConveyor(Conveyor):
    """conveyor with tracing on: every process exports its spans to an OTLP receiver in this process that counts
    them (a collector on another machine, in effect); guidellm sends no `traceparent`, so each request starts a
    sampled trace of its own (the default sampler)."""
    name = "conveyor-traced"

    def __init__(self, model: str, dtype: str, workdir: Path, env: dict[str, str] | None = None) -> None:
        from harness.otlp_receiver import otlp_receiver

        self.receiver = otlp_receiver(decode=False)
        self.sink = self.receiver.__enter__()
        super().__init__(model, dtype, workdir, {**(env or {}), "OTEL_EXPORTER_OTLP_ENDPOINT": self.sink.url})

    def stop(self) -> None:
        super().stop()
        print(f"{self.name}: {self.sink.exports} exports, {self.sink.bytes / 1e6:.1f} MB of spans", file=sys.stderr)
        self.receiver.__exit__(None, None, None)


class UnboundConveyor(Conveyor):
    """conveyor with its compute threads placed by the OS (CPU_BIND_THREADS=false), as several workers on a host."""
    name = "conveyor-unbound"

    def __init__(self, model: str, dtype: str, workdir: Path, env: dict[str, str] | None = None) -> None:
        super().__init__(model, dtype, workdir, {**(env or {}), "CPU_BIND_THREADS": "false"})


class SplitConveyor(Conveyor):
    """conveyor laid out as vLLM-CPU's own default reserves a core on 2: the engine one thread on the last core, every
    other process of the stack on the others (docs/bench-log.md, "Contention": not kept)."""
    name = "conveyor-split"

    def __init__(self, model: str, dtype: str, workdir: Path, env: dict[str, str] | None = None) -> None:
        super().__init__(model, dtype, workdir, {**(env or {}), "CPU_BIND_THREADS": "false", "TORCH_THREADS": "1"})
        cpus = sorted(os.sched_getaffinity(0))
        self.each_thread(lambda role, tid: os.sched_setaffinity(
            tid, {cpus[-1]} if role == "inference" else set(cpus[:-1])))


class BatchConveyor(Conveyor):
    """conveyor with every process but the inference worker under SCHED_BATCH: no wakeup preemption of the engine's
    threads (docs/bench-log.md, "Contention": not kept)."""
    name = "conveyor-batch"

    def __init__(self, model: str, dtype: str, workdir: Path, env: dict[str, str] | None = None) -> None:
        super().__init__(model, dtype, workdir, env)
        self.each_thread(lambda role, tid: role != "inference" and os.sched_setscheduler(
            tid, os.SCHED_BATCH, os.sched_param(0)))


class OneDnnConveyor(Conveyor):
    """conveyor with its linear layers on torch's oneDNN and OpenMP's threads (CPU_GEMM=onednn), as before the
    packed GEMM (docs/bench-log.md, "Contention")."""
    name = "conveyor-onednn"

    def __init__(self, model: str, dtype: str, workdir: Path, env: dict[str, str] | None = None) -> None:
        super().__init__(model, dtype, workdir, {**(env or {}), "CPU_GEMM": "onednn"})


class RevisionConveyor(Conveyor):
    """conveyor as it was at another git revision (`conveyor@REV`: its tree unpacked into the run's workdir, run in
    this environment), side by side with this one: what a change did to serving, in one run."""

    def __init__(self, model: str, dtype: str, workdir: Path, env: dict[str, str] | None = None,
                 rev: str = "HEAD") -> None:
        self.name = f"conveyor@{rev}"
        tree = workdir / "tree"
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        self.stack = start_stack(workdir, None, model, {"DTYPE": dtype, "LOG_LEVEL": "WARNING", **(env or {})},
                                 timeout=600, root=tree)
        self.url = self.stack.url


class Vllm:
    name, metric_prefix = "vllm", "vllm:"

    def __init__(self, model: str, dtype: str, workdir: Path) -> None:
        from bench.serve import VllmServer

        self.server = VllmServer(argparse.Namespace(dtype=dtype, model=model, vllm_timeout=900), workdir, "vllm")
        self.url = self.server.url

    def processes(self) -> tuple[dict[str, list[psutil.Process]], int]:
        root = psutil.Process(self.server.proc.pid)
        procs: dict[str, list[psutil.Process]] = {"api-server": [root]}
        worker = None
        for p in root.children(recursive=True):
            name = p.name()
            role = "worker" if "Worker" in name else "engine-core" if "EngineCore" in name else "other"
            procs.setdefault(role, []).append(p)
            if role == "worker":
                worker = p.pid
        return procs, worker or root.pid

    def stop(self) -> None:
        self.server.stop()


def measure(server, args: argparse.Namespace, streams: int, workdir: Path) -> dict:
    procs, model_pid = server.processes()
    tok0 = generated_tokens(server.url, server.metric_prefix)
    before = snapshot(procs, model_pid)
    t0 = os.times()
    res = guidellm(server.url, args.model, streams, args.seconds, args.prompt_tokens, args.output_tokens, workdir,
                   "vllm" if server.name == "vllm" else None, args.prefetch, args.requests)
    after = snapshot(procs, model_pid)
    t1 = os.times()
    tokens = generated_tokens(server.url, server.metric_prefix) - tok0
    client = (t1.children_user + t1.children_system) - (t0.children_user + t0.children_system)
    res["client_cpu_per_1k"] = round(client * 1000 / max(tokens, 1), 3)  # guidellm itself, on the same cores
    # generated tok/s from the server's own counter: guidellm's figure counts completed requests only
    res.update(server=server.name, streams=streams, tokens=tokens, tok_s=round(tokens / res["duration"], 1),
               cpu_per_1k=diff(before, after, int(tokens)))
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--levels", default="32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seconds", type=float, default=40)
    p.add_argument("--prompt-tokens", type=int, default=40)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--servers", default="conveyor,vllm")
    p.add_argument("--env", action="append", default=[], metavar="K=V",
                   help="an environment variable for conveyor's stack (repeatable), e.g. a setting under test")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed guidellm run on each server")
    p.add_argument("--requests", type=int, default=0, help="end a run after this many requests, if sooner than "
                   "--seconds (default: --seconds only)")
    p.add_argument("--prefetch", type=int, default=0,
                   help="prompts guidellm's data-loader worker makes ahead (default: guidellm's own, 4,096)")
    p.add_argument("--json", dest="json_out")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        # 4 s: a request completes even on a busy machine
        args.servers, args.levels, args.repeats, args.seconds = "conveyor", "1", 1, 4
        args.prompt_tokens, args.output_tokens, args.no_warmup = 16, 4, True
        args.requests, args.prefetch = args.requests or 8, args.prefetch or 8
    args.model = chosen_model(args)
    workdir = Path(tempfile.mkdtemp(prefix="conveyor-cpt-"))
    env = dict(kv.split("=", 1) for kv in args.env)
    servers: list[Conveyor | Vllm] = []
    for name in args.servers.split(","):
        (workdir / name).mkdir(parents=True, exist_ok=True)
        kinds: dict[str, type[Conveyor]] = {"conveyor": Conveyor, "conveyor-traced": TracedConveyor,
                                            "conveyor-unbound": UnboundConveyor,
                                            "conveyor-split": SplitConveyor, "conveyor-batch": BatchConveyor,
                                            "conveyor-onednn": OneDnnConveyor}
        if name.startswith("conveyor+"):  # conveyor+K=V+K2=V2: with these in its environment
            extra = dict(kv.split("=", 1) for kv in name.split("+")[1:])
            servers.append(Conveyor(args.model, args.dtype, workdir / name, {**env, **extra}))
            servers[-1].name = name
        elif name.startswith("conveyor@"):
            servers.append(RevisionConveyor(args.model, args.dtype, workdir / name, env, name.partition("@")[2]))
        else:
            servers.append(kinds[name](args.model, args.dtype, workdir / name, env) if name in kinds
                           else Vllm(args.model, args.dtype, workdir / name))
    runs: list[dict] = []
    try:
        if not args.no_warmup:
            for s in servers:  # one untimed warm-up each
                guidellm(s.url, args.model, 2, 3, args.prompt_tokens, 8, workdir,
                         "vllm" if s.name == "vllm" else None)
        for level in [int(x) for x in args.levels.split(",")]:
            for r in range(args.repeats):
                for s in servers if r % 2 == 0 else servers[::-1]:
                    res = measure(s, args, level, workdir)
                    print(json.dumps(res), file=sys.stderr, flush=True)
                    runs.append(res)
    finally:
        for s in servers:
            s.stop()
    print(f"| server | streams | output tok/s | TTFT p50 ms | ITL p50 ms | model process CPU s / 1k tok | "
          f"all else CPU s / 1k tok |  (medians of {args.repeats})")
    print("|---|---|---|---|---|---|---|")
    for level in [int(x) for x in args.levels.split(",")]:
        for s in servers:
            rs = [r for r in runs if r["server"] == s.name and r["streams"] == level]
            model_role = "inference" if s.name.startswith("conveyor") else "worker"
            own = [r["cpu_per_1k"]["roles"].get(model_role, 0.0) for r in rs]
            rest = [sum(v for k, v in r["cpu_per_1k"]["roles"].items() if k != model_role) for r in rs]
            tok_s, ttft, itl = (statistics.median(r[k] for r in rs) for k in ("tok_s", "ttft_ms", "itl_ms"))
            print(f"| {s.name} | {level} | {tok_s:.0f} | {ttft:.0f} | {itl:.0f} | "
                  f"{statistics.median(own):.2f} | {statistics.median(rest):.2f} |")
    last = {s.name: [r for r in runs if r["server"] == s.name][-1]["cpu_per_1k"] for s in servers}
    print("\nper process and per thread of the model process, CPU s per 1,000 tokens (last run):")
    print(json.dumps(last, indent=1))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    return 0
