"""Network partitions, repeated: each scenario of harness/partitions.py run N times in a row, each run on a stack,
a Redis and network namespaces of its own (harness/netns.py), counting what the partition cost.

    .venv/bin/python -m bench faults partitions                                  # 20 runs of each scenario, tiny model
    .venv/bin/python -m bench faults partitions --runs 3 --scenarios inference,tokenizer
    .venv/bin/python -m bench faults partitions --quick                          # 1 run of each
    .venv/bin/python -m bench faults partitions --runs 5 --model ~/.cache/conveyor/models/SmolLM2-135M-Instruct

Needs root and `ip` (iproute2): it makes namespaces and veth pairs; where it cannot, it says why and exits 2.
The scenarios (see harness/partitions.py for each check):
- `api`: the API alone in a namespace, cut off from Redis while jobs run and clients submit and poll (503 with
  Retry-After within the API's timeouts), then healed (the jobs end succeeded, submits are accepted again).
- `inference`: an inference worker cut off while it runs jobs, past CLAIM_IDLE_MS (3000 ms here); a second worker
  claims and finishes them; once the first is back nothing of the finished jobs changes.
- `tokenizer`: a tokenizer worker cut off holding delivered `jobs` entries; a second one claims and tokenizes them.
- `cluster`: a master of a local Redis Cluster (3 masters, 3 replicas; Debian's redis-server 7) and a client of its
  own cut off from the majority until it is failed over: no write acknowledged on either side (SET, then WAIT 1
  confirming a replica's copy) is lost, and the minority's writes are refused once they cannot be copied. Its
  "accepted" counts acknowledged writes, not jobs. `--min-replicas 0` runs it as conveyor configures its local
  cluster (no min-replicas-to-write), for comparison.

Per scenario it prints a markdown table: runs, runs that passed, jobs accepted, lost (accepted and never ended;
for `cluster`, acknowledged writes missing after the heal), duplicated (an event seq repeated, a text other than
the clean greedy run's, or a finished job changed after its end), and the median cut; then every failed run's
problems. The model is the tiny one (built in a temporary
directory) unless --model names another; decoding is float32 greedy, so a job's text is the same whichever worker
runs or resumes it. Exit status 1 if any run failed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import md_table, quick_model, tree_state
from harness import netns, partitions


def run(args: argparse.Namespace) -> dict[str, list[partitions.Outcome]]:
    results: dict[str, list[partitions.Outcome]] = {}
    work = Path(args.workdir)
    for name in args.scenarios:
        results[name] = []
        for i in range(args.runs):
            workdir = work / f"{name}-{i + 1}"
            if workdir.exists():
                shutil.rmtree(workdir)
            t0 = time.monotonic()
            try:
                extra = {"min_replicas": args.min_replicas, "max_lag_s": args.max_lag,
                         "node_timeout_ms": args.node_timeout_ms} if name == "cluster" else {}
                outcome = partitions.SCENARIOS[name](workdir, args.model, **extra)
            except Exception as e:  # noqa: BLE001 - a run that could not even be set up counts as failed
                outcome = partitions.Outcome(name)
                outcome.problem(f"the run failed: {type(e).__name__}: {e}")
            outcome.notes["run_s"] = round(time.monotonic() - t0, 1)
            results[name].append(outcome)
            print(f"{name} {i + 1}/{args.runs}: {'passed' if outcome.passed else 'FAILED'} in "
                  f"{outcome.notes['run_s']:.0f} s (accepted {outcome.accepted}, lost {outcome.lost}, "
                  f"duplicated {outcome.duplicated}, cut {outcome.notes.get('cut_s', '-')} s)", flush=True)
            if outcome.passed and not args.keep:
                shutil.rmtree(workdir, ignore_errors=True)
    return results


def report(results: dict[str, list[partitions.Outcome]], args: argparse.Namespace) -> str:
    rows = []
    for name, outcomes in results.items():
        cuts = [o.notes["cut_s"] for o in outcomes if "cut_s" in o.notes]
        rows.append([name, len(outcomes), sum(o.passed for o in outcomes), sum(o.accepted for o in outcomes),
                     sum(o.lost for o in outcomes), sum(o.duplicated for o in outcomes),
                     f"{statistics.median(cuts):.1f}" if cuts else "-"])
    out = [md_table(["scenario", "runs", "passed", "accepted (cluster: writes)", "lost", "duplicated",
                     "cut (s, median)"], rows),
           "", f"model {args.model}; code {args.code}"]
    for name, outcomes in results.items():
        for i, o in enumerate(outcomes, 1):
            if not o.passed:
                out.append(f"\n{name} run {i} (workdir {Path(args.workdir) / f'{name}-{i}'}):")
                out += [f"- {p}" for p in o.problems]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20, help="runs of each scenario, in a row")
    ap.add_argument("--scenarios", default=",".join(partitions.SCENARIOS),
                    help=f"comma-separated, of {', '.join(partitions.SCENARIOS)}")
    ap.add_argument("--model", default=None, help="model directory (default: the tiny model)")
    ap.add_argument("--workdir", default="/tmp/conveyor-partitions", help="one directory per run (a failed run's "
                    "is kept: its stack log, its processes' logs, its Redis)")
    ap.add_argument("--keep", action="store_true", help="keep the workdirs of runs that passed too")
    ap.add_argument("--json", default=None, help="write every run's outcome here")
    ap.add_argument("--quick", action="store_true", help="one run of each scenario")
    ap.add_argument("--min-replicas", type=int, default=1, help="cluster: every node's min-replicas-to-write")
    ap.add_argument("--max-lag", type=int, default=1, help="cluster: every node's min-replicas-max-lag (s)")
    ap.add_argument("--node-timeout-ms", type=int, default=2000, help="cluster: cluster-node-timeout")
    args = ap.parse_args(argv)
    reason = netns.unavailable()
    if reason:
        print(f"bench faults partitions cannot run here: {reason}", file=sys.stderr)
        return 2
    if args.quick:
        args.runs = 1
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = set(args.scenarios) - set(partitions.SCENARIOS)
    if unknown:
        ap.error(f"no such scenario: {', '.join(sorted(unknown))}")
    args.model = quick_model(args.model)
    args.code = tree_state()
    results = run(args)
    print()
    print(report(results, args))
    if args.json:
        dump: dict[str, Any] = {name: [o.__dict__ for o in outcomes] for name, outcomes in results.items()}
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": dump}, indent=1, default=str))
    return 0 if all(o.passed for outcomes in results.values() for o in outcomes) else 1
