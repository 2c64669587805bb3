"""What LoRA adapters cost a decode step: the same running sequences with no adapter, all under one adapter, and under
four adapters mixed (a quarter each), against the base alone, switched step by step in one engine so that a shared
machine's drift hits every mode alike.

    .venv/bin/python -m bench engine lora --dtypes bfloat16,float32 --rank 16
    .venv/bin/python -m bench engine lora --quick            # seconds: a tiny random model

The adapters are PEFT's (harness/models.py `make_lora_adapter`: every attention and MLP projection at --rank), made
under --workdir; MAX_LORA_RANK is --rank (each slot that wide) and MAX_LORAS 4. Per dtype and mode: the median step
time over --steps steps at --rows running sequences of --prompt-len tokens (greedy), and output tok/s as a ratio to the
base's in the same run. The modes take turns step by
step (a sequence's adapter is set for the step: a step's cost does not depend on what its K/V holds).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from bench.common import chosen_model, parser

MODES = ("base", "one adapter", "four adapters mixed")


def step_times(model: str, dtype: str, rows: int, steps: int, prompt_len: int, paths: list[str],
               rank: int) -> dict[str, float]:
    from gpu_worker.engine import EngineConfig, LLMEngine
    from shared.schemas import Request

    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, max_num_seqs=max(64, rows), max_loras=len(paths),
                                    max_lora_rank=rank))
    adapters = [engine.loras.acquire(f"a{i}", p) for i, p in enumerate(paths)]
    for i in range(rows):
        prompt = [100 + (i * 7 + j) % 3000 for j in range(prompt_len)]
        engine.add_request(Request(f"r{i}", prompt, max_tokens=10_000, temperature=0.0, ignore_eos=True))
    while engine.num_waiting or any(s.num_uncomputed > 1 for s in engine.scheduler.running):
        engine.step()
    seqs = list(engine.scheduler.running)
    assignments = {"base": [None] * rows, "one adapter": [adapters[0]] * rows,
                   "four adapters mixed": [adapters[i % len(adapters)] for i in range(rows)]}
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for i in range(len(MODES) * (steps + 2)):
        mode = MODES[(i + i // len(MODES)) % len(MODES)]  # each mode in turn, the order rotating every round
        for s, a in zip(seqs, assignments[mode]):
            s.lora = a
        t = time.perf_counter()
        engine.step()
        if i >= 2 * len(MODES):
            times[mode].append(time.perf_counter() - t)
    for s in seqs:
        s.lora = None
    return {m: statistics.median(v) * 1e3 for m, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    from harness.models import make_lora_adapter

    p = parser(__doc__)
    p.add_argument("--dtypes", default="bfloat16")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--workdir", default="/tmp/conveyor-bench-lora")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.steps = 8, 3
    model = chosen_model(args)
    work = Path(args.workdir)
    paths = [make_lora_adapter(work / f"a{i}-r{args.rank}", model, i, r=args.rank, scale=0.05) for i in range(4)]
    print(f"| dtype | mode | step ms | output tok/s | against the base |  ({args.rows} rows, rank {args.rank}, "
          f"{args.steps} steps a mode, interleaved; medians)")
    print("|---|---|---:|---:|---:|")
    for dtype in args.dtypes.split(","):
        ms = step_times(model, dtype, args.rows, args.steps, args.prompt_len, paths, args.rank)
        for mode in MODES:
            print(f"| {dtype} | {mode} | {ms[mode]:.1f} | {args.rows / ms[mode] * 1e3:.0f} "
                  f"| {ms['base'] / ms[mode]:.2f}x |", flush=True)
    return 0
