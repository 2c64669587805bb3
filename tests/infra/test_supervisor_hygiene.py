"""`conveyor up` leaves nothing behind, even when it is killed outright, and a second `conveyor up`
on the same data directory refuses to start beside a live stack. The stack runs on its own
embedded redis-server and a tiny model."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.conftest import ROOT, start_stack


def _state(cache: Path) -> dict:  # type: ignore[type-arg]
    return json.loads((cache / "supervisor.json").read_text())


def _descendants(pid: int) -> set[int]:
    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return set()


def _alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.add(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def test_sigkill_of_the_supervisor_takes_every_child_along(tmp_path: Path, tiny_model_dir: str) -> None:
    stack = start_stack(tmp_path, "", tiny_model_dir, extra={"DRAIN_GRACE_S": "5"})
    everything: set[int] = set()
    try:
        state = _state(tmp_path)
        assert state["redis_pids"] and all(p["pids"] for p in state["pools"].values()), state
        everything = _descendants(stack.proc.pid)  # api, workers, output lane, celery (+ beat), redis-server
        assert set(state["redis_pids"]) <= everything and len(everything) >= 6, everything

        second = subprocess.run([sys.executable, "-m", "infra.cli", "up", "--no-autoscale"], env=stack.env,
                                cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert second.returncode != 0
        assert "already running" in second.stderr + second.stdout
        assert _state(tmp_path)["pid"] == stack.proc.pid  # the live stack is untouched

        redis_pid = state["redis_pids"][0]
        guard = {p for p in everything if "infra.redis_guard" in psutil.Process(p).cmdline()}
        assert len(guard) == 1
        stack.proc.send_signal(signal.SIGKILL)
        stack.proc.wait(10)
        deadline = time.monotonic() + 60
        left = _alive(everything)
        while left and time.monotonic() < deadline:
            redis_gone = redis_pid not in _alive({redis_pid})
            left = _alive(everything)
            # redis-server goes last (but for the guard that stops it), so that draining workers can
            # still record what they finish
            assert not redis_gone or left <= guard, [psutil.Process(p).cmdline() for p in left]
            time.sleep(0.1)
        assert not left, [psutil.Process(p).cmdline() for p in left]
        assert not (tmp_path / "redis" / "connection.json").exists()
    finally:
        if stack.proc.poll() is None:
            stack.proc.kill()
        for pid in _alive(everything):  # only this stack's processes: the session's stacks live on
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()


def test_a_child_that_dies_takes_what_it_left_in_its_group_along() -> None:
    """A pool's child killed -9 (a Celery worker: its beat is a child of its own) leaves nothing behind once
    the pool reaps it."""
    from infra.supervisor import Pool

    leaves_a_child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; " \
                     "time.sleep(300)']); time.sleep(300)"
    pool = Pool("test", [sys.executable, "-c", leaves_a_child], {}, 1)
    pool.reconcile()
    first = pool.children[0].proc
    try:
        deadline = time.monotonic() + 30
        while not _descendants(first.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = _descendants(first.pid)
        assert left
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        pool.reconcile()
        deadline = time.monotonic() + 10
        while _alive(left) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(left)
    finally:
        pool.stop()
        pool.wait(time.monotonic() + 10)


def test_a_child_drained_on_scale_down_is_killed_past_its_deadline() -> None:
    """Scaled down, a worker drains; one that never exits (wedged, or ignoring SIGTERM) is killed once its drain and
    its lane's stop are past, rather than left beside its replacement."""
    from infra.supervisor import Pool

    pool = Pool("test", [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                                "time.sleep(300)"], {}, 1, grace_s=0)
    pool.reconcile()
    child = pool.children[0]
    try:
        def ignores_sigterm() -> bool:  # its SIGTERM handler set (SigIgn in /proc: a mask of signals ignored)
            status = Path(f"/proc/{child.proc.pid}/status").read_text()
            return bool(int(status.split("SigIgn:")[1].split()[0], 16) & (1 << (signal.SIGTERM - 1)))

        deadline = time.monotonic() + 30
        while not ignores_sigterm() and time.monotonic() < deadline:
            time.sleep(0.02)
        pool.target = 0
        pool.reconcile()
        assert child.stopping and child.proc.poll() is None  # told, and ignoring it
        child.stop_by = time.monotonic() - 1  # its deadline passed
        pool.reconcile()
        assert child.proc.wait(10) == -signal.SIGKILL
        pool.reconcile()
        assert pool.children == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            child.proc.kill()
