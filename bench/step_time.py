"""Decode-step time at fixed batch sizes, and a prefill step warm against after idling.

    .venv/bin/python -m bench engine step --batches 1,8,32 --dtypes float32,bfloat16
    .venv/bin/python -m bench engine step --batches 32 --kernels on,off,on,off
    .venv/bin/python -m bench engine step --batches "" --after-idle 8 --dtypes bfloat16

Per --dtypes and batch size: loads the engine, prefills B identical-length prompts (--prompt-len tokens), takes
3 untimed decode steps, then reports the median (and min) of --steps timed decode steps: the number to compare
when changing the model runner (alternate two trees; single runs minutes apart are not comparable).
`--kernels on,off` times each batch both ways, alternating: with the compiled CPU kernels (the default: decode
attention read in place, fused layer steps) and with torch's ops only (CPU_KERNELS=false). `--after-idle S` times
a --prompt-len prefill step warm (right after another request) and after the process has slept S seconds,
alternately, 3 times each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench.common import chosen_model, parser


def step_time(model: str, dtype: str, batch: int, steps: int, prompt_len: int,
              kernels: bool = True) -> tuple[float, float]:
    """Median and min decode-step time (ms) at `batch` running sequences, after a prefill of all of them."""
    from gpu_worker.engine import EngineConfig, LLMEngine
    from shared.schemas import Request

    engine = LLMEngine(EngineConfig(model=model, device="cpu", dtype=dtype, max_num_seqs=max(64, batch),
                                    max_num_batched_tokens=0, cpu_kernels=kernels))
    prompt = list(range(100, 100 + prompt_len))
    for i in range(batch):
        engine.add_request(Request(f"r{i}", prompt, max_tokens=10_000, temperature=0.0, ignore_eos=True))
    while engine.num_waiting or any(q.num_uncomputed > 1 for q in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3, min(times) * 1e3


def after_idle(model: str, dtype: str, idle_s: float, prompt_len: int) -> tuple[list[float], list[float]]:
    """A prefill step's time (ms) right after another request and after `idle_s` of sleep, 3 times each."""
    from gpu_worker.engine import EngineConfig, LLMEngine
    from shared.schemas import Request

    engine = LLMEngine(EngineConfig(model=model, device="cpu", dtype=dtype))
    prompt = list(range(100, 100 + prompt_len))

    def prefill_ms(tag: str) -> float:
        engine.add_request(Request(tag, prompt, max_tokens=2, temperature=0.0, ignore_eos=True))
        t = time.perf_counter()
        engine.step()
        took = (time.perf_counter() - t) * 1e3
        while engine.has_unfinished():
            engine.step()
        return took

    for i in range(3):
        prefill_ms(f"w{i}")
    warm, idle = [], []
    for i in range(3):
        warm.append(prefill_ms(f"a{i}"))
        time.sleep(idle_s)
        idle.append(prefill_ms(f"b{i}"))
    return warm, idle


def report(args: argparse.Namespace) -> None:
    for dtype in args.dtypes.split(","):
        for batch in (int(b) for b in args.batches.split(",") if b):
            for kernels in args.kernels.split(","):
                med, low = step_time(args.model, dtype, batch, args.steps, args.prompt_len, kernels == "on")
                print(f"{dtype:9s} batch {batch:3d} kernels {kernels:3s}: decode step {med:6.1f} ms median "
                      f"(min {low:.1f}), {batch / med * 1e3:6.0f} tok/s if every step were like this", flush=True)
        if args.after_idle:
            warm, idle = after_idle(args.model, dtype, args.after_idle, args.prompt_len)
            print(f"{dtype:9s} {args.prompt_len}-token prefill step: warm {' / '.join(f'{x:.0f}' for x in warm)} ms, "
                  f"after {args.after_idle:g} s idle {' / '.join(f'{x:.0f}' for x in idle)} ms", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--batches", default="1,8,32", help="batch sizes (running sequences) to time a decode step at")
    p.add_argument("--kernels", default="on", help="compiled CPU kernels on, off, or both alternating (on,off)")
    p.add_argument("--after-idle", type=float, default=0.0, help="also time a prefill step after this many s idle")
    p.add_argument("--dtypes", default="float32,bfloat16", help="engine dtypes")
    p.add_argument("--steps", type=int, default=15, help="timed steps per batch size")
    p.add_argument("--prompt-len", type=int, default=40, help="prompt tokens per request")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.after_idle = 3, min(args.after_idle, 0.1)
    args.model = chosen_model(args)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, GOMP_SPINCOUNT="
          f"{os.environ.get('GOMP_SPINCOUNT', 'unset')}")
    report(args)
    return 0
