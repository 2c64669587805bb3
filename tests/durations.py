"""What each of the suite's work units took in a whole run (tests/durations.json), so that the longest go first.

A unit is what one worker runs at a time: a group (`--dist loadgroup`, tests/conftest.py) or a test alone. Handed
out longest first, a run ends on short tests with every worker busy, rather than on a 45 s failover test with the
CPU half idle (xdist's own order is groups by size, then single tests as collected). Units the file does not name
(new tests) count as 0 s and go last, in xdist's order. `make test-durations` (a whole run with `-p tests.durations`)
writes it again."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import pytest

FILE = Path(__file__).with_name("durations.json")
KEPT_S = 2.0  # units shorter than this are left out of the file: they order as new tests do
_GROUP_SUFFIX = re.compile(r"@([\w.]+)$")  # a grouped test's id ends in its group (tests/conftest.py `_name_group`)


def unit_of(nodeid: str) -> str:
    """The unit a reported test belongs to: its group, or itself."""
    match = _GROUP_SUFFIX.search(nodeid)
    return match.group(1) if match else nodeid


def load() -> dict[str, float]:
    try:
        data: dict[str, float] = json.loads(FILE.read_text())
    except (OSError, ValueError):
        return {}
    return data


# as a plugin (`-p tests.durations`): each unit's phases (setup, call, teardown) summed as the reports arrive (in
# xdist's controller, from every worker), and the file written at the session's end, longest first
_SECONDS: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _SECONDS[unit_of(report.nodeid)] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller writes
        return
    kept = {unit: round(s, 1) for unit, s in sorted(_SECONDS.items(), key=lambda kv: -kv[1]) if s >= KEPT_S}
    FILE.write_text(json.dumps(kept, indent=0) + "\n")
