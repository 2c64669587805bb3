"""Decode-step time of the in-process engine at fixed batch sizes: the number to compare when
changing the model runner. Each run loads the engine, prefills N identical-length prompts, takes
3 untimed decode steps, then reports the median (and min) of --steps timed decode steps.

    .venv/bin/python bench/step_time.py                                  # float32 and bfloat16 at 1, 8, 32
    .venv/bin/python bench/step_time.py --dtypes float32 --batch 8,32

Compare two versions side by side by alternating runs (e.g. `git stash` between them); the machine's
speed drifts, so single runs minutes apart are not comparable.

    .venv/bin/python bench/step_time.py --after-idle 8 --dtypes bfloat16   # a prefill step after 8 s idle

`--after-idle S` instead times a 40-token prefill step warm (right after another request) and after the
process has slept S seconds, alternately, 3 times each: what the first request after a quiet spell pays.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT_MODEL = str(Path.home() / ".cache/conveyor/models/SmolLM2-135M-Instruct")


def step_time(model: str, dtype: str, batch: int, steps: int, prompt_len: int) -> tuple[float, float]:
    from gpu_worker.engine import EngineConfig, LLMEngine, Request

    engine = LLMEngine(EngineConfig(model=model, device="cpu", dtype=dtype, max_num_seqs=max(64, batch),
                                    max_num_batched_tokens=0))
    prompt = list(range(100, 100 + prompt_len))
    for i in range(batch):
        engine.add_request(Request(f"r{i}", prompt, max_tokens=10_000, temperature=0.0, ignore_eos=True))
    while engine.num_waiting or any(s.num_uncomputed > 1 for s in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3, min(times) * 1e3


def after_idle(model: str, dtype: str, idle_s: float, prompt_len: int) -> None:
    from gpu_worker.engine import EngineConfig, LLMEngine, Request

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
    print(f"{dtype:9s} {prompt_len}-token prefill step: warm {' / '.join(f'{x:.0f}' for x in warm)} ms, "
          f"after {idle_s:g} s idle {' / '.join(f'{x:.0f}' for x in idle)} ms", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.environ.get("MODEL") or DEFAULT_MODEL)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--batch", default="1,8,32")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--prompt-len", type=int, default=40)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--after-idle", type=float, default=0.0, help="time a prefill step after this many seconds idle")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, GOMP_SPINCOUNT="
          f"{os.environ.get('GOMP_SPINCOUNT', 'unset')}")
    for dtype in args.dtypes.split(","):
        if args.after_idle:
            after_idle(args.model, dtype, args.after_idle, args.prompt_len)
            continue
        for batch in (int(b) for b in args.batch.split(",")):
            med, low = step_time(args.model, dtype, batch, args.steps, args.prompt_len)
            print(f"{dtype:9s} batch {batch:3d}: decode step {med:6.1f} ms median (min {low:.1f}), "
                  f"{batch / med * 1e3:6.0f} tok/s if every step were like this", flush=True)


if __name__ == "__main__":
    main()
