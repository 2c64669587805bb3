"""Runs that go on beside the rest of the suite: self-contained work that no other test touches (the benchmarks'
`--quick` runs, the schema fuzzer, lm-eval's reference run, and the checks that start a stack, a Redis or a
cluster of their own: kill -9 of Redis, of workers, of the supervisor). The suite's other tests leave much of
the machine's CPU idle (they wait on stacks, Redis, timeouts); these runs use it.

A test module registers what it starts (`@background_run(name)`: resolves its fixtures in the main thread and
submits its work to the session's `Background`); its tests are marked `background`, run after every other
test (tests/conftest.py orders them), and read what the work returned. A module whose checks share what they
start (a stack of its own) runs them `in_turn` in one run, and each of its tests raises what its check raised
(`Background.outcome`). Only the modules with a selected test start anything. Alone (no other test selected),
the runs get `ALONE_LANES` lanes; beside other tests, `BESIDE_LANES`.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import pytest

ALONE_LANES = 4  # twice the machine's 2 cores: the runs spend part of their time waiting on what they started
BESIDE_LANES = 2  # one kept the background the suite's longest lane once stacks of their own had moved there
T = TypeVar("T")
Starter = Callable[[pytest.FixtureRequest, "Background"], object]
STARTERS: dict[str, tuple[str, Starter]] = {}  # name -> (the module that registered it, its starter)


def background_run(name: str) -> Callable[[Starter], Starter]:
    """Register a module's starter under `name`: called once per session when a test of that module is selected."""
    def register(fn: Starter) -> Starter:
        STARTERS[name] = (fn.__module__, fn)
        return fn
    return register


class Background:
    """The session's background lanes, and what each started run handed back (`handle`)."""

    def __init__(self, lanes: int) -> None:
        self.lanes = lanes
        self.pool = ThreadPoolExecutor(lanes, thread_name_prefix="background")
        self.handles: dict[str, object] = {}
        self.began = time.monotonic()
        self.spans: list[tuple[str, float, float]] = []  # (run, start, end), seconds into the session

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        """Run `fn` in the next free lane; when it ran is kept (`spans`: the summary at the session's end)."""
        label = " ".join(str(a) for a in args[0][1:3]) if fn is subprocess.run else getattr(fn, "__name__", str(fn))

        def timed() -> T:
            start = time.monotonic() - self.began
            try:
                return fn(*args, **kwargs)
            finally:
                self.spans.append((label[:60], start, time.monotonic() - self.began))
        return self.pool.submit(timed)

    def start(self, request: pytest.FixtureRequest, modules: set[str]) -> None:
        for name, (module, starter) in STARTERS.items():
            if module in modules:
                self.handles[name] = starter(request, self)

    def handle(self, name: str) -> Any:
        assert name in self.handles, f"{name}: not started (its module had no selected test)"
        return self.handles[name]

    def outcome(self, name: str, check: str) -> None:
        """Wait for the `in_turn` run `name`, then raise what its `check` raised (nothing where it held)."""
        error = self.handle(name).result()[check]
        if error is not None:
            raise error

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def in_turn(checks: Mapping[str, Callable[[], object]]) -> dict[str, Exception | None]:
    """Each of `checks` in turn: what each raised, None where it held."""
    out: dict[str, Exception | None] = {}
    for name, check in checks.items():
        try:
            check()
            out[name] = None
        except Exception as e:  # noqa: BLE001 - the check's test raises it (`Background.outcome`)
            out[name] = e
    return out
