"""What an idle stack costs: CPU per process while no job runs, as % of one core.

    .venv/bin/python bench/idle_cpu.py                  # 30 s, after 10 s to settle
    .venv/bin/python bench/idle_cpu.py --seconds 60

Starts `conveyor up --no-autoscale` (its own redis-server, the default model, one tokenizer and one
inference worker, the Celery worker with beat), waits until it is ready and has settled, then reads
each process's CPU time (user + system, psutil over the supervisor's process tree) before and after
--seconds of doing nothing. On a machine whose cores the engine wants, every idle wake-up counts.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import DEFAULT_MODEL, md_table, process_tree, start_stack, stop_stack, wait_ready  # noqa: E402
from infra.redis_server import free_port  # noqa: E402


def cpu_by_role(sup_pid: int) -> dict[tuple[str, int], float]:
    out = {}
    for role, proc in process_tree(sup_pid):
        try:
            out[(role, proc.pid)] = sum(proc.cpu_times()[:2])
        except psutil.Error:
            continue
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--settle", type=float, default=10.0, help="wait this long after ready before measuring")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    args = ap.parse_args()
    stack = start_stack(Path(tempfile.mkdtemp(prefix="conveyor-idle-")), free_port(), args.model, {}, 1, 1)
    try:
        wait_ready(stack)
        time.sleep(args.settle)
        before, t0 = cpu_by_role(stack.proc.pid), time.monotonic()
        time.sleep(args.seconds)
        after, wall = cpu_by_role(stack.proc.pid), time.monotonic() - t0
    finally:
        stop_stack(stack)
    share: dict[str, float] = {}
    for (role, pid), t in after.items():
        share[role] = share.get(role, 0.0) + (t - before.get((role, pid), t)) / wall * 100
    rows = [[role, f"{pct:.1f}"] for role, pct in sorted(share.items())]
    rows.append(["**all**", f"{sum(share.values()):.1f}"])
    print(f"\nIdle stack, {wall:.0f} s, CPU as % of one core:\n")
    print(md_table(["process", "CPU %"], rows))


if __name__ == "__main__":
    main()
