"""Several benchmarks' `--quick` runs in one process, one after another: what the smoke test of the benchmarks
(tests/bench/test_bench_quick.py) uses for those that need no stack, so that they share one interpreter and
one import of torch instead of paying for one each.

    .venv/bin/python -m bench.quick OUTDIR '{"NAME": ["BENCHMARK", "MODE", "ARG", ...], ...}'

Each run is `python -m bench BENCHMARK MODE ARG ...` in this process (bench/__main__.py), its standard output
in OUTDIR/NAME.out and its exit status in OUTDIR/NAME.rc (then the traceback, if it raised). Every run is
attempted, in the order given; the exit status is 1 if any failed. A run that changes process-wide settings
(`engine compile`: inductor's) goes last.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import traceback
from pathlib import Path

from bench.__main__ import run
from shared.lifecycle import exit_quickly


def run_one(argv: list[str], out: Path) -> tuple[int, str]:
    """(exit status, traceback or message) of the benchmark `argv` names, its standard output written to `out`."""
    with out.open("w") as f, contextlib.redirect_stdout(f):
        try:
            code = run(argv)
        except SystemExit as exc:
            code = exc.code
        except Exception:  # noqa: BLE001 - reported, and the next run still runs
            return 1, traceback.format_exc()
        finally:
            sys.stdout.flush()
    if code is None or isinstance(code, int):
        return code or 0, ""
    return 1, str(code)  # SystemExit("message")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        raise SystemExit(__doc__)
    outdir, runs = Path(argv[0]), json.loads(argv[1])
    outdir.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name, argv in runs.items():
        print(f"[quick] {name}: {' '.join(argv)}", file=sys.stderr, flush=True)
        started, cpu = time.monotonic(), time.process_time()
        code, why = run_one(argv, outdir / f"{name}.out")
        print(f"[quick] {name}: {time.monotonic() - started:.1f} s, {time.process_time() - cpu:.1f} CPU-s",
              file=sys.stderr, flush=True)  # what each costs the suite
        (outdir / f"{name}.rc").write_text(f"{code}\n{why}")
        if code:
            print(f"[quick] {name} failed (exit {code})\n{why}", file=sys.stderr, flush=True)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    exit_quickly(main())
