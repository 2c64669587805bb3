"""Time to first token at an empty inference pool against a warm one: `conveyor up --inference 0` (scale to zero) on
its own Redis; each round waits until the idle pool has drained to zero, submits a job (the supervisor starts a
worker for it), and right after it ends submits the same job again to the pool still warm. TTFT is measured at the
client: from the submit's answer to the job's first token event on its SSE stream.

    .venv/bin/python -m bench cold-start from-zero --rounds 3          # default model, the default dtype
    .venv/bin/python -m bench cold-start from-zero --quick             # tiny model, one round

What an empty pool adds is the worker's start (bench cold-start: imports, the model's load, the first call) plus the
supervisor's period (AUTOSCALE_PERIOD_S, 0.5 s here) before it sees the queued job.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import chosen_model, parser
from harness.sse import iter_sse
from harness.stack import start_stack, stop_stack
from shared import names


def ttft(url: str, prompt: str) -> float:
    with httpx.Client(base_url=url, timeout=300) as c:
        job: dict[str, Any] = c.post("/v1/jobs", json={"prompt": prompt, "max_tokens": 16, "temperature": 0,
                                                       "ignore_eos": True}).json()
        t = time.perf_counter()
        first = None
        with c.stream("GET", f"/v1/jobs/{job['id']}/events") as resp:
            for ev in iter_sse(resp):
                if ev.get("event") == "token" and first is None:
                    first = time.perf_counter() - t
                if ev.get("event") in ("done", "error"):
                    break
        assert first is not None, f"job {job['id']} gave no token"
        return first


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cooldown", type=float, default=3.0, help="SCALE_IN_COOLDOWN_S: idle time before zero")
    p.add_argument("--workdir", default="/tmp/conveyor-from-zero")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.cooldown = 1, 1.0
    model = chosen_model(args)
    stack = start_stack(Path(args.workdir), "", model, {"AUTOSCALE_PERIOD_S": "0.5",
                                                        "SCALE_IN_COOLDOWN_S": str(args.cooldown),
                                                        "LOG_LEVEL": "WARNING"}, ["--inference", "0"], autoscale=True)
    cold, warm = [], []
    try:
        for r in range(args.rounds):
            deadline = time.monotonic() + 300
            while stack.worker_pids(names.INFERENCE_POOL):
                if time.monotonic() > deadline:
                    raise SystemExit("the idle pool never drained to zero")
                time.sleep(0.25)
            prompt = f"Round {r}: tell me about the sea."
            cold.append(ttft(stack.url, prompt))
            warm.append(ttft(stack.url, prompt))
            print(f"round {r}: TTFT at an empty pool {cold[-1]:.2f} s, warm {warm[-1]:.3f} s", flush=True)
    finally:
        stop_stack(stack)
    print(f"| pool | TTFT, median of {args.rounds} |\n|---|---:|\n| empty (scaled to zero) | "
          f"{statistics.median(cold):.2f} s |\n| warm | {statistics.median(warm):.3f} s |")
    return 0
