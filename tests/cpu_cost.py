"""What each test costs in CPU, for finding where the suite's time goes (it is CPU-bound on 2 cores).

    PYTHONPATH=. PYTHONDONTWRITEBYTECODE= .venv/bin/pytest -q -n 3 -p tests.cpu_cost --cpu-cost /tmp/cpu-cost
    .venv/bin/python -m tests.cpu_cost /tmp/cpu-cost        # by module, most CPU first

Each test's CPU is the pytest worker's own (in-process engines, clients) plus its children's: the processes it
started and reaped (stacks, benchmarks, reference runs). A fixture's processes count where the fixture is torn down:
a shared stack's whole life lands on the last test of its worker that used it; what each test's body took in the
stacks it was given is listed apart. Wall time is the test's whole
protocol (setup, call, teardown), inflated by whatever ran beside it.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

ROWS: list[tuple[str, float, float, float]] = []  # (test id, own CPU s, children's CPU s, wall s)
STACK_ROWS: list[tuple[str, float]] = []  # (test id, CPU s its call took in the stacks it was given)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-cost", metavar="DIR", help="write each test's CPU cost to DIR (one file per worker)")


def _cpu() -> tuple[float, float]:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    own, kids = _cpu()
    started = time.monotonic()
    try:
        return (yield)
    finally:
        own_after, kids_after = _cpu()
        ROWS.append((item.nodeid, own_after - own, kids_after - kids, time.monotonic() - started))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """What the test's body took in the stacks given to it (a shared stack's processes outlive the test, so their
    CPU lands nowhere else until the stack stops): the tests on one stack run one at a time, in one worker."""
    from harness.stack import Stack, cpu_seconds

    stacks = [v for v in getattr(item, "funcargs", {}).values() if isinstance(v, Stack)]

    def used() -> float:
        return sum(cpu for stack in stacks for (role, _), cpu in cpu_seconds(stack).items() if role != "client")

    before = used()
    try:
        return (yield)
    finally:
        if stacks:
            STACK_ROWS.append((item.nodeid, used() - before))


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = session.config.getoption("--cpu-cost")
    if out and ROWS:
        Path(out).mkdir(parents=True, exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        (Path(out) / f"{worker}.json").write_text(json.dumps(ROWS))
        (Path(out) / f"{worker}.stacks").write_text(json.dumps(STACK_ROWS))


def summary(out: Path) -> list[str]:
    """Each module's CPU (own + children's), wall time and tests, most CPU first, then the totals."""
    by_module: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for path in sorted(out.glob("*.json")):
        for test_id, own, kids, wall in json.loads(path.read_text()):
            row = by_module[test_id.split("::")[0]]
            row[0], row[1], row[2], row[3] = row[0] + own, row[1] + kids, row[2] + wall, row[3] + 1
    lines = [f"{own + kids:8.1f} CPU-s (own {own:6.1f}, children {kids:6.1f})  wall {wall:6.1f} s  {int(n):4d}  {m}"
             for m, (own, kids, wall, n) in sorted(by_module.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))]
    own_all, kids_all = sum(r[0] for r in by_module.values()), sum(r[1] for r in by_module.values())
    in_stacks = sorted((row for path in out.glob("*.stacks") for row in json.loads(path.read_text())),
                       key=lambda row: -row[1])
    return [*lines, f"{own_all + kids_all:8.1f} CPU-s in all (own {own_all:.1f}, children {kids_all:.1f})",
            f"in the stacks given to tests, {sum(cpu for _, cpu in in_stacks):.1f} CPU-s; the most:",
            *(f"{cpu:8.1f} CPU-s  {test_id}" for test_id, cpu in in_stacks[:30])]


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print("\n".join(summary(Path(sys.argv[1]))))
