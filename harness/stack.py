"""One way to start the whole stack for a test or a benchmark: `conveyor up` as a child process on a
free port, on a given Redis or on the embedded redis-server the supervisor starts, ready when an
HTTP path answers 200; its processes found by role; stopped cleanly (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psutil
import redis

from infra.redis_server import free_port, read_local_redis_url
from shared.lifecycle import preexec_die_with_parent
from shared.redis_client import sync_client

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")
ROLES = ("supervisor", "redis-server", "api", "tokenizer", "inference", "output-lane", "celery", "celery-beat",
         "mp-helper", "other")


@dataclass
class Stack:
    """A running `conveyor up`: its URL, its Redis, the child process, its environment and log."""

    url: str
    redis_url: str
    proc: subprocess.Popen[bytes]
    env: dict[str, str]
    log: Path
    seen: set[int] = field(default_factory=set)  # every pid of the tree ever seen, for the check at stop

    def wait_ready(self, ready_path: str = "/readyz", timeout: float = 180.0) -> Stack:
        """Wait until `ready_path` answers 200 (and an embedded Redis's URL is known); stopped if it never does."""
        try:
            wait_http(self.url + ready_path, self.proc, timeout, f"the stack (log {self.log})", self.tree)
            if not self.redis_url:  # the supervisor's own: its connection file is under the stack's workdir
                workdir = Path(self.env["CONVEYOR_CACHE"])
                self.redis_url = read_local_redis_url(workdir) or ""
                if not self.redis_url:
                    raise RuntimeError(f"no Redis connection file under {workdir / 'redis'}")
        except BaseException:
            stop_stack(self, timeout=10)
            raise
        return self

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def redis(self) -> redis.Redis:
        return sync_client(self.redis_url)  # a cluster's client when it is one

    def worker_pids(self, pool: str) -> list[int]:
        """Live workers of a pool, from their heartbeats."""
        from shared.signals import read_snapshot

        return [w.pid for w in read_snapshot(self.redis(), (pool,), {}).workers[pool]]

    def tree(self) -> list[tuple[str, psutil.Process]]:
        out = process_tree(self.proc.pid)
        self.seen.update(p.pid for _, p in out)
        return out

    def by_role(self, role: str) -> list[psutil.Process]:
        return [p for r, p in self.tree() if r == role]

    def pause(self, *roles: str) -> None:
        for role in roles:
            for p in self.by_role(role):
                p.send_signal(signal.SIGSTOP)

    def resume(self, *roles: str) -> None:
        for role in roles:
            for p in self.by_role(role):
                p.send_signal(signal.SIGCONT)


def kernel_cache(env: dict[str, str]) -> str:
    """The compiled-kernel cache a worker started with `env` would use (gpu_worker/engine/cpu_kernels.py)."""
    if env.get("CONVEYOR_KERNEL_CACHE"):
        return env["CONVEYOR_KERNEL_CACHE"]
    root = env.get("CONVEYOR_CACHE") or str(Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "conveyor")
    return str(Path(root) / "kernels")


def start_stack(workdir: Path, redis_url: str | None = None, model: str = "", extra: dict[str, str] | None = None,
                args: list[str] | None = None, ready_path: str = "/readyz", autoscale: bool = False,
                timeout: float = 180.0, root: Path = ROOT) -> Stack:
    """`launch_stack`, then `Stack.wait_ready`: returns once `ready_path` answers 200."""
    return launch_stack(workdir, redis_url, model, extra, args, autoscale, root).wait_ready(ready_path, timeout)


def launch_stack(workdir: Path, redis_url: str | None = None, model: str = "", extra: dict[str, str] | None = None,
                 args: list[str] | None = None, autoscale: bool = False, root: Path = ROOT) -> Stack:
    """`conveyor up` (with `--no-autoscale` unless `autoscale`) on a free port, started and not waited for;
    `CONVEYOR_CACHE` and the log (`stack.log`) under `workdir`. With `redis_url` empty the supervisor starts its own
    redis-server and `Stack.redis_url` is read from its connection file once ready (`Stack.wait_ready`). `root`: the
    source tree it runs (a benchmark's other revision, bench/cpu_per_token.py), in this environment."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = dict(os.environ)
    # the internal port (/metrics, /scaling) too is one the system handed out: its default, PORT + 1, was never
    # checked and may be another process's
    env.update({"REDIS_URL": redis_url or "", "PORT": str(port), "INTERNAL_PORT": str(free_port()),
                "HOST": "127.0.0.1", "CONVEYOR_CACHE": str(workdir), "LOG_LEVEL": "WARNING",
                # the compiled decode attention kernel stays where it was built once, not rebuilt in every workdir
                "CONVEYOR_KERNEL_CACHE": kernel_cache(env)})
    if model:
        env["MODEL"] = model
    if root != ROOT:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(root), env.get("PYTHONPATH"))))
    env.update(extra or {})
    log = workdir / "stack.log"
    flags = [] if autoscale else ["--no-autoscale"]
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "infra.cli", "up", *flags, *(args or [])], env=env, cwd=root,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=preexec_die_with_parent())  # a killed run leaves no stack behind
    return Stack(f"http://127.0.0.1:{port}", redis_url or "", proc, env, log)


def until(what: str, condition: Callable[[], T], timeout: float, every: float = 0.05,
          error: type[Exception] = TimeoutError) -> T:
    """The first truthy value of `condition()`; `error` naming `what` once `timeout` has passed."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise error(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float, what: str = "", each_poll: Any = None) -> None:
    """Poll `url` until it answers 200, failing early if `proc` exits."""
    what = what or url
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what}: exited with {proc.returncode} before it was ready")
        if each_poll is not None:
            each_poll()
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{what}: not ready after {timeout:.0f}s")


def stop_stack(stack: Stack, timeout: float = 60.0) -> list[int]:
    """SIGTERM the supervisor (it drains and stops its children); SIGKILL its session after the timeout.
    Returns the pids of the tree that outlived it and had to be killed."""
    stack.tree()
    if stack.proc.poll() is None:
        stack.resume("tokenizer", "inference")  # a paused worker cannot drain
        stack.proc.send_signal(signal.SIGTERM)
        try:
            stack.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError, psutil.NoSuchProcess):
                os.killpg(stack.proc.pid, signal.SIGKILL)
            stack.proc.wait()
    leftovers = []
    deadline = time.monotonic() + 5
    for pid in sorted(stack.seen - {stack.proc.pid}):
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                p.wait(max(0.0, deadline - time.monotonic()))
        except psutil.TimeoutExpired:
            leftovers.append(pid)
            with contextlib.suppress(ProcessLookupError, PermissionError, psutil.NoSuchProcess):
                p.kill()
        except psutil.NoSuchProcess:
            pass
    return leftovers


def process_tree(sup_pid: int) -> list[tuple[str, psutil.Process]]:
    """(role, process) for the supervisor and every descendant; roles as in ROLES (the output lane is a
    child of an inference worker, celery-beat a child of the Celery worker)."""
    try:
        root = psutil.Process(sup_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    return [(role, p) for p in procs if (role := classify(p, sup_pid))]


INFERENCE = re.compile(r"infra\.cli inference\b")


def classify(p: psutil.Process, sup_pid: int) -> str | None:
    try:
        if p.pid == sup_pid:
            return "supervisor"
        cmd = " ".join(p.cmdline())
        if "redis-server" in p.name() or "redis-server" in cmd:
            return "redis-server"
        parent = p.parent()
        parent_cmd = " ".join(parent.cmdline()) if parent is not None else ""
        if INFERENCE.search(parent_cmd) and (INFERENCE.search(cmd) or "spawn_main" in cmd):
            return "output-lane"  # forked by its worker (gpu_worker/worker.py lane_context), or spawned
        for role in ("api", "tokenizer", "inference"):
            if re.search(rf"infra\.cli {role}\b", cmd):
                return role
        if "spawn_main" in cmd:
            return "mp-helper"
        if "workers.celery_app" in cmd:  # the worker, and beat forked from it
            return "celery-beat" if "workers.celery_app" in parent_cmd else "celery"
        if "resource_tracker" in cmd or "forkserver" in cmd:
            return "mp-helper"
        return "other"
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def cpu_seconds(stack: Stack | None) -> dict[tuple[str, int], float]:
    """CPU seconds (user + system) so far of each process of the stack, keyed by (role, pid), and of this
    process (the load generator) as ("client", pid)."""
    me = psutil.Process()
    out = {("client", me.pid): sum(me.cpu_times()[:2])}
    for role, proc in stack.tree() if stack is not None else []:
        try:
            out[(role, proc.pid)] = sum(proc.cpu_times()[:2])
        except psutil.Error:
            continue
    return out


def cpu_share(before: dict[tuple[str, int], float], after: dict[tuple[str, int], float],
              wall: float) -> dict[str, float]:
    """Per role: CPU used between two snapshots, as a percentage of one core over `wall` seconds."""
    share: dict[str, float] = {}
    for key, t in after.items():
        share[key[0]] = share.get(key[0], 0.0) + (t - before.get(key, 0.0)) / wall * 100
    return share


def scan_log(path: Path) -> dict[str, Any]:
    """Counts of what matters in the stack's log: tracebacks, errors, worker exits, claims, warnings."""
    text = path.read_text(errors="replace") if path.exists() else ""
    lines = text.splitlines()
    warnings: dict[str, int] = {}
    for ln in lines:
        if " WARNING " in ln:
            msg = re.sub(r"\d+(\.\d+)?", "N", re.sub(r"\[\d+\]", "[N]", re.sub(r"^.*? WARNING ", "", ln)))[:160]
            warnings[msg] = warnings.get(msg, 0) + 1
    return {
        "lines": len(lines),
        "tracebacks": text.count("Traceback (most recent call last)"),
        "errors": [ln for ln in lines if " ERROR " in ln or " CRITICAL " in ln],
        "exits": [ln for ln in lines if re.search(r"pid \d+ exited with", ln)],
        "claims": sum("claimed " in ln for ln in lines),
        "warnings": warnings,
    }
