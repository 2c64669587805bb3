"""In-process generation: named contenders on the same workload, interleaved, one Markdown table.

    .venv/bin/python -m bench engine generate             # full default run: 15-20 minutes on 2 idle cores
    .venv/bin/python -m bench engine generate --quick     # seconds: a tiny random model, 2 requests x 3 tokens
    .venv/bin/python -m bench engine generate --profile   # also break down a decode step, per --dtypes

Workload: N requests drawn round-robin from 16 short chat prompts (rendered with the model's chat
template, about 30-45 tokens), each generating exactly --max-new tokens (greedy, EOS ignored).
Two arrival modes:

- `all`: everything is submitted at once by a client that keeps at most --concurrency requests
  in flight (a new one is submitted, and its clock starts, when one finishes);
- `poisson`: an open stream at --rate requests/s, arrival times precomputed from a fixed seed.

Contenders (CONTENDERS: a name, how to load it, how to run it):

- `naive`     transformers `pipeline("text-generation")`, one request at a time;
- `static`    `model.generate` over left-padded batches of --static-batch requests;
- `hf-cb`     transformers' own continuous batching (`init_continuous_batching`, per-token timestamps);
- `ours-fp32` and `ours-bf16`: `gpu_worker.engine.LLMEngine`.

Output tok/s is generated tokens / (last completion - first arrival). TTFT runs from a request's
arrival to its first token, ITL is the gap between consecutive tokens of one request. The last two
columns are each row's tok/s over the naive row of the same mode, and the share of the CPU that other
processes used meanwhile. Every figure is the median over --repeats; contenders are interleaved inside
each repeat so that the machine's drift hits them alike, and a run disturbed by other processes (more
than --max-noise of the CPU) is redone, up to --retries times, after waiting for a quiet machine.
Finally the fp32 engine's tokens are compared with batch-1 `generate` (--check requests).
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import os
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import TypeVar

import torch

from bench.common import PROMPTS, CpuShare, chosen_model, fmt, parser, percentile, quiet, wait_for_quiet

T = TypeVar("T")
MODES = ("all", "poisson")


# ----------------------------------------------------------------------------- workload and clients


@dataclass
class Workload:
    messages: list[list[dict]]  # chat messages per request (what the pipeline is given)
    prompt_ids: list[list[int]]  # the same, rendered and tokenized
    max_new: int

    @property
    def n(self) -> int:
        return len(self.prompt_ids)


def build_workload(tokenizer, n: int, max_new: int) -> Workload:
    messages = [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(n)]
    ids = [list(tokenizer.apply_chat_template(m, add_generation_prompt=True, return_dict=False)) for m in messages]
    return Workload(messages, ids, max_new)


@dataclass
class Record:
    arrival: float = float("nan")
    token_times: list[float] = field(default_factory=list)  # one per generated token
    tokens: list[int] = field(default_factory=list)
    done: float = float("nan")


class Client:
    """Decides when each request arrives; the same object drives real and virtual clocks.

    `all`: the first `concurrency` requests arrive at 0, each later one when an earlier one finishes.
    `poisson`: arrival times fixed in advance. Times are seconds from the start of the run.
    """

    def __init__(self, n: int, mode: str, concurrency: int, rate: float, seed: int) -> None:
        self.n, self.mode = n, mode
        self.records = [Record() for _ in range(n)]
        self._heap: list[tuple[float, int]] = []
        self._next = 0  # next request index not yet scheduled (closed loop)
        if mode == "all":
            for _ in range(min(concurrency, n)):
                self._schedule(0.0)
        else:
            rng = random.Random(seed)
            t = 0.0
            for i in range(n):
                self._heap.append((t, i))
                t += rng.expovariate(rate)
            self._next = n

    def _schedule(self, t: float) -> None:
        if self._next < self.n:
            heapq.heappush(self._heap, (t, self._next))
            self._next += 1

    def arrived(self, now: float) -> list[int]:
        """Requests whose arrival time has passed, in arrival order; each is returned once."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            t, i = heapq.heappop(self._heap)
            self.records[i].arrival = t
            out.append(i)
        return out

    def next_arrival(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def finish(self, i: int, now: float) -> None:
        self.records[i].done = now
        if self.mode == "all":
            self._schedule(now)

    def all_done(self) -> bool:
        return all(r.done == r.done for r in self.records)  # NaN != NaN


class Clock:
    """Seconds since the start of a timed run."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def sleep_until(self, t: float | None) -> None:
        if t is not None:
            time.sleep(max(0.0, t - self.now()))


# ----------------------------------------------------------------------------- metrics


@dataclass
class Result:
    tok_s: float
    ttft_p50: float  # milliseconds
    ttft_p99: float
    itl_p50: float  # nan where the contender does not stream
    itl_p99: float
    noise: float = float("nan")  # share of the CPU other processes used during the run


def summarise(records: list[Record], streams: bool) -> Result:
    tokens = sum(len(r.token_times) for r in records)
    wall = max(r.done for r in records) - min(r.arrival for r in records)
    ttft = [(r.token_times[0] - r.arrival) * 1e3 for r in records]
    itl = [(b - a) * 1e3 for r in records for a, b in zip(r.token_times, r.token_times[1:])] if streams else []
    return Result(tokens / wall, percentile(ttft, 50), percentile(ttft, 99), percentile(itl, 50), percentile(itl, 99))


def check_counts(name: str, records: list[Record], max_new: int) -> None:
    bad = [i for i, r in enumerate(records) if len(r.token_times) != max_new]
    if bad:
        raise RuntimeError(f"{name}: requests {bad[:8]} did not produce exactly {max_new} tokens "
                           f"(got {[len(records[i].token_times) for i in bad[:8]]})")


# ----------------------------------------------------------------------------- contenders


@dataclass
class Setup:
    args: argparse.Namespace
    workload: Workload
    tokenizer: object
    hf_model: torch.nn.Module  # float32, shared by naive and static (both stateless)
    pipe: object = None
    cb_model: torch.nn.Module | None = None  # own copy: continuous batching swaps the attention implementation
    engines: dict = field(default_factory=dict)
    naive_service: dict[int, float] = field(default_factory=dict)  # prompt index -> seconds, per repeat


def run_naive(s: Setup, client: Client) -> list[Record]:
    """One request at a time through `pipeline`. A sequential server's service time does not depend on
    arrivals, so each distinct prompt is timed once per repeat (see `measure_naive`) and the arrival
    timeline is replayed on a virtual clock with those times."""
    wl = s.workload
    queue: deque[int] = deque()
    t = 0.0
    while not client.all_done():
        queue.extend(client.arrived(t))
        if not queue:
            t = client.next_arrival()
            continue
        i = queue.popleft()
        t += s.naive_service[i % len(PROMPTS)]
        rec = client.records[i]
        rec.token_times = [t] * wl.max_new  # the whole answer comes back at once
        client.finish(i, t)
    return client.records


def measure_naive(s: Setup) -> dict[int, float]:
    """Times the pipeline on up to --naive-subset distinct prompts, back to back: prompt index -> seconds."""
    wl, k = s.workload, min(s.args.naive_subset or len(PROMPTS), len(PROMPTS), s.workload.n)
    service: dict[int, float] = {}
    for i in range(k):
        t = time.perf_counter()
        s.pipe(wl.messages[i], max_new_tokens=wl.max_new, do_sample=False, eos_token_id=None,
               return_full_text=False)
        service[i] = time.perf_counter() - t
    for i in range(k, len(PROMPTS)):  # prompts not timed: mean of those that were
        service[i] = statistics.fmean(service[j] for j in range(k))
    return service


def run_static(s: Setup, client: Client) -> list[Record]:
    """`model.generate` over left-padded batches of whatever has arrived, up to --static-batch."""
    wl, tok, clock = s.workload, s.tokenizer, Clock()
    queue: deque[int] = deque()
    while not client.all_done():
        queue.extend(client.arrived(clock.now()))
        if not queue:
            clock.sleep_until(client.next_arrival())
            continue
        batch = [queue.popleft() for _ in range(min(s.args.static_batch, len(queue)))]
        enc = tok.pad({"input_ids": [wl.prompt_ids[i] for i in batch]}, padding=True, return_tensors="pt")
        with torch.inference_mode():
            out = s.hf_model.generate(**enc, max_new_tokens=wl.max_new, do_sample=False, eos_token_id=None)
        t = clock.now()
        width = enc["input_ids"].shape[1]
        for row, i in enumerate(batch):
            rec = client.records[i]
            rec.tokens = out[row, width:].tolist()
            rec.token_times = [t] * len(rec.tokens)
            client.finish(i, t)
    return client.records


def start_hf_cb(s: Setup):
    from transformers import ContinuousBatchingConfig, GenerationConfig

    a = s.args
    gen = GenerationConfig(max_new_tokens=s.workload.max_new, do_sample=False, eos_token_id=-1)
    # sized explicitly: left to itself it sizes the KV cache from free host memory (gigabytes, seconds)
    cfg = ContinuousBatchingConfig(num_blocks=2 * a.concurrency + 16, max_batch_tokens=a.batch_tokens,
                                   max_requests_per_batch=a.concurrency)
    manager = s.cb_model.init_continuous_batching(generation_config=gen, continuous_batching_config=cfg)
    manager.start()
    manager.add_request(s.workload.prompt_ids[0], request_id="warmup", max_new_tokens=2)
    if manager.get_result(timeout=120) is None:
        raise RuntimeError("hf-cb: warm-up request got no result")
    return manager


def run_hf_cb(s: Setup, client: Client) -> list[Record]:
    """transformers' continuous batching: a background thread steps, per-token timestamps recorded."""
    wl = s.workload
    manager = start_hf_cb(s)
    try:
        clock = Clock()
        while not client.all_done():
            for i in client.arrived(clock.now()):
                manager.add_request(wl.prompt_ids[i], request_id=str(i), max_new_tokens=wl.max_new,
                                    record_timestamps=True)
            nxt = client.next_arrival()
            wait = 1.0 if nxt is None else max(0.0, nxt - clock.now())
            out = manager.get_result(timeout=wait) if wait > 0 else None
            if out is None:
                if not manager.is_running():
                    raise RuntimeError("hf-cb: generation thread stopped")
                continue
            if not out.is_finished():
                continue
            if out.error:
                raise RuntimeError(f"hf-cb: request {out.request_id} failed: {out.error}")
            i = int(out.request_id)
            rec = client.records[i]
            rec.tokens = list(out.generated_tokens)
            rec.token_times = [ts - clock.t0 for ts in out.timestamps]
            client.finish(i, clock.now())
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    return client.records


def run_ours(s: Setup, client: Client, dtype: str) -> list[Record]:
    """Our engine: add what has arrived, step while there is work, otherwise sleep to the next arrival."""
    from shared.schemas import Request

    wl, engine, clock = s.workload, s.engines[dtype], Clock()
    while not client.all_done():
        for i in client.arrived(clock.now()):
            engine.add_request(Request(str(i), wl.prompt_ids[i], max_tokens=wl.max_new, temperature=0.0,
                                       ignore_eos=True))
        if not engine.has_unfinished():
            clock.sleep_until(client.next_arrival())
            continue
        outputs = engine.step()
        t = clock.now()
        for o in outputs:
            rec = client.records[int(o.id)]
            if o.error:
                raise RuntimeError(f"ours-{dtype}: request {o.id} failed: {o.error}")
            rec.tokens.extend(o.token_ids)
            rec.token_times.extend([t] * len(o.token_ids))
            if o.finish_reason is not None:
                client.finish(int(o.id), t)
    return client.records


def load_naive(s: Setup) -> None:
    from transformers import pipeline

    s.pipe = pipeline("text-generation", model=s.hf_model, tokenizer=s.tokenizer)


def load_hf_cb(s: Setup) -> None:
    from transformers import AutoModelForCausalLM

    s.cb_model = AutoModelForCausalLM.from_pretrained(s.args.model, dtype=torch.float32).eval()


def load_ours(s: Setup, dtype: str) -> None:
    s.engines[dtype] = make_engine(s.args.model, dtype, s.args)


@dataclass(frozen=True)
class Contender:
    """A named way to generate: `load` puts what it needs on the Setup once; `run` serves one arrival
    timeline (the Client) and returns its records; `streams` is whether it reports tokens as they come."""

    name: str
    run: Callable[[Setup, Client], list[Record]]
    streams: bool
    load: Callable[[Setup], None] | None = None


CONTENDERS = [
    Contender("naive", run_naive, False, load_naive),
    Contender("static", run_static, False),
    Contender("hf-cb", run_hf_cb, True, load_hf_cb),
    Contender("ours-fp32", partial(run_ours, dtype="float32"), True, partial(load_ours, dtype="float32")),
    Contender("ours-bf16", partial(run_ours, dtype="bfloat16"), True, partial(load_ours, dtype="bfloat16")),
]
BY_NAME = {c.name: c for c in CONTENDERS}


def one_run(s: Setup, name: str, mode: str) -> tuple[Result, list[Record]]:
    c, a, wl = BY_NAME[name], s.args, s.workload
    recs = c.run(s, Client(wl.n, mode, a.concurrency, a.rate, a.seed))
    check_counts(name, recs, wl.max_new)
    return summarise(recs, c.streams), recs


def measured(args: argparse.Namespace, label: str, fn: Callable[[], T]) -> tuple[T, float, int]:
    """Runs fn once the machine is quiet; redoes it (up to --retries times) when other processes took more
    than --max-noise of the CPU meanwhile. Returns the quietest attempt's result, its noise, and the redos."""
    best: tuple[T, float] | None = None
    redos = 0
    for attempt in range(args.retries + 1):
        wait_for_quiet(args.max_noise, args.quiet_wait)
        t, cpu = time.perf_counter(), CpuShare()
        out = fn()
        share = cpu.others()
        share = float("nan") if share is None else share
        rate = f", {out[0].tok_s:.1f} tok/s" if isinstance(out, tuple) else ""
        print(f"  {label}: {time.perf_counter() - t:.0f} s{rate}, other processes {share:.0%} of the CPU",
              file=sys.stderr, flush=True)
        if best is None or not share >= best[1]:  # NaN (no /proc) counts as quiet
            best = (out, share)
        if not share > args.max_noise or attempt == args.retries:
            break
        redos += 1
    return best[0], best[1], redos


# ----------------------------------------------------------------------------- setup, guard, profile


def make_engine(model: str, dtype: str, args: argparse.Namespace):
    from gpu_worker.engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model=model, device="cpu", dtype=dtype, max_num_seqs=args.concurrency,
                                  max_num_batched_tokens=args.batch_tokens))


def build_setup(args: argparse.Namespace) -> Setup:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    s = Setup(args, build_workload(tok, args.n, args.max_new), tok, model)
    for name in args.only:
        if BY_NAME[name].load is not None:
            BY_NAME[name].load(s)
    return s


def warm_up(s: Setup) -> None:
    """Untimed: first calls into oneDNN and the allocator are slow; also checks token counts."""
    small = Workload(s.workload.messages[:2], s.workload.prompt_ids[:2], 4)
    real, s.workload = s.workload, small
    try:
        for name in s.args.only:
            if name == "naive":
                out = s.pipe(small.messages[0], max_new_tokens=4, do_sample=False, eos_token_id=None,
                             return_tensors=True)
                got = len(out[0]["generated_token_ids"]) - len(small.prompt_ids[0])
                if got != 4:
                    raise RuntimeError(f"naive: pipeline produced {got} tokens, expected 4")
                continue
            recs = BY_NAME[name].run(s, Client(2, "all", 2, 1.0, 0))
            check_counts(name, recs, 4)
    finally:
        s.workload = real


def batch1_reference(s: Setup, k: int) -> list[list[int]]:
    wl = s.workload
    out = []
    with torch.inference_mode():
        for i in range(k):
            ids = torch.tensor([wl.prompt_ids[i]])
            gen = s.hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=wl.max_new,
                                      do_sample=False, eos_token_id=None)
            out.append(gen[0, ids.shape[1]:].tolist())
    return out


@contextlib.contextmanager
def timed_parts(runner, parts: dict[str, list[float]]) -> Iterator[None]:  # type: ignore[no-untyped-def]
    """While inside: the seconds of each call `ModelRunner.run` makes to the model's forward, the logits
    (lm_head) and the sampler, appended to parts["forward"], ["logits"] and ["sample"]."""
    targets = {"forward": (runner.model, "forward"), "logits": (runner, "_logits"), "sample": (runner, "sampler")}
    own = {name: vars(obj).get(attr) for name, (obj, attr) in targets.items()}  # instance attributes to put back

    def timed(fn: Callable, times: list[float]) -> Callable:
        def call(*a, **kw):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                times.append(time.perf_counter() - t)
        return call

    for name, (obj, attr) in targets.items():
        setattr(obj, attr, timed(getattr(obj, attr), parts[name]))
    try:
        yield
    finally:
        for name, (obj, attr) in targets.items():
            if own[name] is None:
                delattr(obj, attr)  # the class's method again
            else:
                setattr(obj, attr, own[name])


def profile_step(s: Setup, dtype: str = "float32", concurrency: int = 32, steps: int = 5) -> None:
    """Time decode steps at `concurrency` running sequences: the whole step (median) against what `ModelRunner.run`
    spends in the model's forward, the lm_head and the sampler (means), then the top operators of one step under
    torch.profiler."""
    from shared.schemas import Request

    engine = s.engines.get(dtype) or make_engine(s.args.model, dtype, s.args)
    wl = s.workload
    for i in range(concurrency):
        engine.add_request(Request(f"p{i}", wl.prompt_ids[i % wl.n], max_tokens=10_000, temperature=0.0,
                                   ignore_eos=True))
    while engine.num_waiting or any(q.num_uncomputed > 1 for q in engine.scheduler.running):
        engine.step()  # prefill everything first
    for _ in range(3):
        engine.step()
    parts: dict[str, list[float]] = {"forward": [], "logits": [], "sample": []}
    step_times = []
    with timed_parts(engine.runner, parts):
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - t)
    step = statistics.median(step_times) * 1e3
    ms = {name: sum(times) / steps * 1e3 for name, times in parts.items()}
    print(f"\nprofile: {dtype} decode step at {concurrency} running: step {step:.1f} ms median of {steps}; "
          f"model forward {ms['forward']:.1f} ms, lm_head {ms['logits']:.1f} ms, sampler {ms['sample']:.1f} ms; "
          f"inputs + schedule + bookkeeping {step - sum(ms.values()):.1f} ms "
          f"({concurrency / step * 1e3:.0f} tok/s if every step were like this)")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    for i in range(concurrency):
        engine.abort_request(f"p{i}")
    while engine.has_unfinished():
        engine.step()


# ----------------------------------------------------------------------------- main


def print_table(results: dict[tuple[str, str], list[Result]], only: list[str], modes: list[str]) -> dict:
    print("| contender | mode | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) "
          "| × naive | others' CPU |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    med = {k: Result(*(statistics.median(getattr(r, f) for r in rs) for f in Result.__dataclass_fields__))
           for k, rs in results.items()}
    for mode in modes:
        base = med.get(("naive", mode))
        for name in only:
            r = med[(name, mode)]
            ratio = f"{r.tok_s / base.tok_s:.1f}×" if base else "n/a"
            label = name + ("¹" if name in ("naive", "static") else "")
            print(f"| {label} | {mode} | {fmt(r.tok_s, 1)} | {fmt(r.ttft_p50)} | {fmt(r.ttft_p99)} "
                  f"| {fmt(r.itl_p50, 1)} | {fmt(r.itl_p99, 1)} | {ratio} | {fmt(r.noise * 100)}% |")
    return med


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--n", type=int, default=64, help="requests per run")
    p.add_argument("--max-new", type=int, default=64, help="tokens generated per request")
    p.add_argument("--concurrency", type=int, default=32,
                   help="`all` mode: requests in flight; also the batch cap of the continuous batchers")
    p.add_argument("--rate", type=float, default=8.0, help="`poisson` mode: requests per second")
    p.add_argument("--repeats", type=int, default=3, help="runs per contender and mode; figures are medians")
    p.add_argument("--only", default=",".join(BY_NAME), help=f"comma-separated subset of {','.join(BY_NAME)}")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of all,poisson")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    p.add_argument("--static-batch", type=int, default=8)
    p.add_argument("--batch-tokens", type=int, default=512,
                   help="token budget per step for ours (max_num_batched_tokens) and hf-cb (max_batch_tokens)")
    p.add_argument("--naive-subset", type=int, default=len(PROMPTS),
                   help="distinct prompts the naive pipeline is timed on per repeat (0: all of them)")
    p.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrival times")
    p.add_argument("--max-noise", type=float, default=0.15,
                   help="redo a run when other processes used more than this share of the CPU during it")
    p.add_argument("--retries", type=int, default=2, help="redos per run at most (the quietest attempt is kept)")
    p.add_argument("--quiet-wait", type=float, default=30.0,
                   help="seconds to wait, before each run, for other processes to fall under --max-noise")
    p.add_argument("--check", type=int, default=4, help="requests compared with batch-1 generate (0: skip)")
    p.add_argument("--profile", action="store_true", help="also profile a decode step at --concurrency running")
    p.add_argument("--dtypes", default="float32,bfloat16", help="--profile: the engine dtypes to profile")
    p.add_argument("--json", dest="json_out", help="also write the medians here, and a chart beside it (.png)")
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.max_new, args.concurrency, args.rate, args.repeats = 2, 3, 2, 50.0, 1
        args.naive_subset, args.retries, args.quiet_wait, args.check = 2, 0, 0.0, 2
    args.model = chosen_model(args)
    args.only = [c for c in args.only.split(",") if c]
    modes = [m for m in args.modes.split(",") if m]
    unknown = [c for c in args.only if c not in BY_NAME] + [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown contender or mode: {unknown}")

    quiet()
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    torch.manual_seed(0)
    started = datetime.now(UTC)
    print(f"# engine benchmark, {started:%Y-%m-%d %H:%M} UTC\n")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()} of {os.cpu_count()} cores, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, model {args.model}")
    s = build_setup(args)
    wl = s.workload
    lens = [len(x) for x in wl.prompt_ids]
    print(f"workload: {wl.n} requests, prompts {min(lens)}-{max(lens)} tokens, {wl.max_new} new tokens each, "
          f"greedy, EOS ignored; all: {args.concurrency} in flight; poisson: {args.rate:g} req/s (seed "
          f"{args.seed}); {args.repeats} repeat(s)\n")
    if not args.quick:  # the measured runs check their token counts themselves
        warm_up(s)

    results: dict[tuple[str, str], list[Result]] = {(c, m): [] for c in args.only for m in modes}
    ours_tokens: dict[str, list[list[int]]] = {}
    naive_noise, redone = float("nan"), 0
    for rep in range(args.repeats):
        if "naive" in args.only:
            label = f"repeat {rep + 1} naive timing"
            s.naive_service, naive_noise, n = measured(args, label, partial(measure_naive, s))
            redone += n
        for mode in modes:
            for name in args.only:
                if name == "naive":  # a replay of measure_naive's timings: nothing to wait for
                    (res, recs), share = one_run(s, name, mode), naive_noise
                else:
                    (res, recs), share, n = measured(args, f"repeat {rep + 1} {mode:7s} {name:9s}",
                                                     partial(one_run, s, name, mode))
                    redone += n
                res.noise = share
                results[(name, mode)].append(res)
                if name.startswith("ours") and name not in ours_tokens:
                    ours_tokens[name] = [r.tokens for r in recs]

    print()
    med = print_table(results, args.only, modes)
    k = min(len(PROMPTS), wl.n)
    print(f"\n¹ does not stream: TTFT is the time until the request's whole `generate` returns, from its arrival; "
          f"ITL n/a. naive: timed back to back on {min(args.naive_subset or k, k)} distinct prompt(s) per repeat, "
          f"the {wl.n}-request timeline replayed with those per-prompt times (a one-at-a-time server's service "
          f"time does not depend on arrivals).")
    print(f"noise: the last column is the share of the machine's CPU that other processes used during the kept "
          f"runs (median); {redone} run(s) were redone for exceeding --max-noise {args.max_noise:.0%}.")
    all_mode = "all" if "all" in modes else modes[0]
    ours = med.get(("ours-fp32", all_mode))
    for other in ("naive", "hf-cb"):
        if ours and (other, all_mode) in med:
            print(f"ours-fp32 / {other} ({all_mode}): {ours.tok_s / med[(other, all_mode)].tok_s:.2f}×")

    if args.check and "ours-fp32" in ours_tokens:
        k = min(args.check, wl.n)
        ref = batch1_reference(s, k)
        same = sum(ours_tokens["ours-fp32"][i] == ref[i] for i in range(k))
        line = f"correctness: ours-fp32 greedy tokens == batch-1 `generate` for {same}/{k} requests"
        if "ours-bf16" in ours_tokens:
            b = sum(ours_tokens["ours-bf16"][i] == ref[i] for i in range(k))
            line += f" (ours-bf16: {b}/{k}, not expected to be bit-identical)"
        print(line)
        if same != k:
            print("WARNING: ours-fp32 differs from batch-1 generate", file=sys.stderr)

    if args.json_out:
        from bench.plot import plot_rows

        rows = [{"target": name, "level": mode, **asdict(r)} for (name, mode), r in med.items()]
        Path(args.json_out).write_text(json.dumps({"when": started.isoformat(timespec="seconds"),
                                                   "args": vars(args), "results": rows}, indent=2, default=str))
        plot_rows(rows, Path(args.json_out).with_suffix(".png"),
                  f"engine in process: {wl.n} requests x {wl.max_new} tokens, {args.concurrency} in flight",
                  x_label="arrivals")
    if args.profile:
        for dtype in args.dtypes.split(","):
            profile_step(s, dtype, args.concurrency)
    print(f"\nfinished in {(datetime.now(UTC) - started).total_seconds() / 60:.1f} min")
    return 0


