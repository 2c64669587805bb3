"""`conveyor up`: the whole stack on one machine.

Starts Redis (unless REDIS_URL is set: one redis-server, or a local cluster; infra/embedded_redis.py),
the API, the worker pools and a Celery worker (with beat
embedded: after-job work, batch driving and upkeep) as child processes, and with `--traces` a local
Phoenix (infra/phoenix.py) that they all export their spans to;
restarts a crashed child with backoff; scales pools on queue lag when autoscaling is on;
on Ctrl-C or SIGTERM stops everything it started (workers drain first), leaving nothing behind.

Every child also dies with the supervisor when it is killed outright (SIGKILL): each is started
with PR_SET_PDEATHSIG (SIGTERM: workers still drain), and the embedded redis-server goes last
(infra/redis_guard.py), so that draining workers can still record what they finish. One stack per data directory: the
supervisor holds an exclusive lock on `<cache>/conveyor.lock`, and so does every child it starts
(the descriptor is inherited), so a second `conveyor up` refuses until the first stack is gone.
Its state (pools, pids, restarts) is in `<cache>/supervisor.json`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from infra import phoenix
from infra.autoscale import Autoscaler
from infra.embedded_redis import EmbeddedRedis
from infra.redis_server import CONNECTION_FILE
from shared import names
from shared.lifecycle import preexec_die_with_parent, worker_stop_s
from shared.settings import Settings

log = logging.getLogger("conveyor.supervisor")


@dataclass
class Child:
    proc: subprocess.Popen[bytes]
    started: float = field(default_factory=time.monotonic)
    stopping: bool = False
    stop_by: float = math.inf  # when draining: the moment it is killed if it has not exited


def _kill_group(pgid: int) -> None:
    """SIGKILL whatever is left in a reaped child's process group (it led one: start_new_session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


class Pool:
    """A set of identical child processes that can grow, shrink and be restarted."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], size: int,
                 min_size: int = 1, max_size: int = 1, grace_s: float = 30.0, keep_fds: tuple[int, ...] = ()) -> None:
        self.name, self.argv, self.env, self.keep_fds = name, argv, env, keep_fds
        self.target, self.min_size, self.max_size, self.grace_s = size, min_size, max_size, grace_s
        self.children: list[Child] = []
        self.restarts = 0
        self._next_restart = 0.0
        self._backoff = 1.0

    def _spawn(self) -> None:
        proc = subprocess.Popen(self.argv, env=self.env, start_new_session=True, pass_fds=self.keep_fds,
                                preexec_fn=preexec_die_with_parent(signal.SIGTERM))
        self.children.append(Child(proc))
        log.info("%s: started pid %d (%d running)", self.name, proc.pid, len(self.live()))

    def live(self) -> list[Child]:
        return [c for c in self.children if not c.stopping and c.proc.poll() is None]

    def reconcile(self) -> None:
        """Reap exited children, restart crashes with backoff, and move toward the target size."""
        now = time.monotonic()
        for c in list(self.children):
            code = c.proc.poll()
            if code is None:
                if now > c.stop_by:  # drained past its deadline (scaled down): wedged; its jobs are claimed
                    log.warning("%s: pid %d did not stop in time; killing it", self.name, c.proc.pid)
                    _kill_group(c.proc.pid)
                    c.stop_by = math.inf
                continue
            self.children.remove(c)
            _kill_group(c.proc.pid)  # what it left in its group (Celery's beat, a killed worker's children)
            if not c.stopping:
                log.warning("%s: pid %d exited with %s", self.name, c.proc.pid, code)
                self.restarts += 1
                quick = now - c.started < 30
                self._backoff = min(self._backoff * 2, 30.0) if quick else 1.0
                self._next_restart = now + (self._backoff if quick else 0)
        live = self.live()
        if len(live) < self.target and now >= self._next_restart:
            for _ in range(self.target - len(live)):
                self._spawn()
        elif len(live) > self.target:
            for c in live[self.target :][::-1]:
                self._drain(c)

    def _drain(self, c: Child) -> None:
        c.stopping = True
        c.stop_by = time.monotonic() + worker_stop_s(self.grace_s) + 5
        log.info("%s: draining pid %d", self.name, c.proc.pid)
        c.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        for c in self.children:
            if c.proc.poll() is None:
                c.stopping = True
                c.proc.send_signal(signal.SIGTERM)

    def wait(self, deadline: float) -> None:
        for c in self.children:
            left = max(0.0, deadline - time.monotonic())
            try:
                c.proc.wait(left)
            except subprocess.TimeoutExpired:
                log.warning("%s: pid %d did not stop in time; killing it", self.name, c.proc.pid)
                with contextlib.suppress(ProcessLookupError):  # (it ended just now)
                    os.killpg(c.proc.pid, signal.SIGKILL)
                c.proc.wait()
            else:
                try:
                    os.killpg(c.proc.pid, signal.SIGKILL)  # anything it left in its group
                except ProcessLookupError:
                    pass


class StackLock:
    """One stack per data directory: an exclusive flock, held by the supervisor and its children."""

    def __init__(self, cache_dir: Path) -> None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        self.path = cache_dir / "conveyor.lock"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise SystemExit(f"a conveyor stack is already running on {cache_dir} (lock {self.path} is held): "
                             "stop it first, or set CONVEYOR_CACHE to another directory") from None
        os.ftruncate(self.fd, 0)
        os.write(self.fd, f"{os.getpid()}\n".encode())

    def release(self) -> None:
        os.close(self.fd)


def write_state(path: Path, url: str, pools: list[Pool], redis_pids: list[int]) -> None:
    """The supervisor's view for operators and tests: each pool's pids and restarts, Redis's pids."""
    state = {"pid": os.getpid(), "url": url, "updated_at": time.time(), "redis_pids": redis_pids,
             "pools": {p.name: {"pids": [c.proc.pid for c in p.live()], "target": p.target, "restarts": p.restarts}
                       for p in pools}}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(path)


def _wait_ready(url: str, stop: threading.Event, timeout: float = 300.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stop.is_set():
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=2) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            pass
        stop.wait(0.5)
    return False


def celery_argv(settings: Settings) -> list[str]:
    """One Celery worker with beat embedded (a process of its own, in the worker's group): all the background
    work, the after-job drain and the batch driver side by side in each run of its task (workers/celery_app.py)
    and upkeep; `--pool solo` runs one task at a time."""
    home = settings.cache_dir / "celery"
    home.mkdir(parents=True, exist_ok=True)
    return [sys.executable, "-m", "celery", "--quiet", "--app", "workers.celery_app", "worker", "--beat",
            "--pool", "solo", "--loglevel", "WARNING", "--schedule", str(home / "beat-schedule"),
            "--hostname", "conveyor@%h", "--without-gossip", "--without-mingle", "--without-heartbeat"]


def one_worker_binds(env: dict[str, str], most_workers: int) -> dict[str, str]:
    """CPU_BIND_THREADS for the inference workers: on when this stack runs at most one of them on this host
    (vLLM-CPU binds its own; gpu_worker/cpu_affinity.py), unless the operator chose; several would crowd the same
    cores."""
    return {} if "CPU_BIND_THREADS" in env or most_workers > 1 else {"CPU_BIND_THREADS": "true"}


@dataclass
class Pools:
    """Every child pool of a stack, in the order they start: Phoenix (with --traces) first, the API, the worker
    pools (the tokenizers', one inference pool per model), Celery."""

    traces: list[Pool]
    api: Pool
    workers: dict[str, Pool]
    celery: list[Pool]

    @property
    def everything(self) -> list[Pool]:
        return [*self.traces, self.api, *self.workers.values(), *self.celery]

    def stop(self, grace_s: float) -> None:
        """The API first (no new work comes in), then Celery and the pools drain together (its ends stay queued),
        Phoenix last (it takes the spans they export as they stop)."""
        self.api.stop()
        self.api.wait(time.monotonic() + 10)
        for p in (*self.celery, *self.workers.values()):
            p.stop()
        for p in self.celery:
            p.wait(time.monotonic() + 10)
        deadline = time.monotonic() + worker_stop_s(grace_s) + 5
        for p in self.workers.values():
            p.wait(deadline)
        for p in self.traces:
            p.stop()
            p.wait(time.monotonic() + 10)


def _pools(settings: Settings, env: dict[str, str], keep: tuple[int, ...], tokenizers: int, inference: int,
           autoscale: bool, celery: bool, traces_port: int) -> Pools:
    """The stack's pools, none started; `env` gains what every child shares (OpenTelemetry's settings)."""
    traces: list[Pool] = []
    if traces_port:  # Phoenix, on loopback: every child's spans go to it (shared/tracing.py)
        workdir = settings.cache_dir / "phoenix"
        traces.append(Pool("phoenix", phoenix.phoenix_command(traces_port, workdir),
                           phoenix.phoenix_env(traces_port, workdir), 1, grace_s=10, keep_fds=keep))
        env.update(phoenix.otel_env(phoenix.endpoint(traces_port), env))
    cli = [sys.executable, "-m", "infra.cli"]
    env["INFERENCE_MIN"] = str(inference)  # the API's readiness: a pool that may be empty need not have a worker
    grace = settings.drain_grace_s
    workers = {
        names.TOKENIZER_POOL: Pool(names.TOKENIZER_POOL, cli + ["tokenizer"], env, tokenizers,
                                   min_size=tokenizers, max_size=max(tokenizers, settings.tokenizer_max)
                                   if autoscale else tokenizers, grace_s=grace, keep_fds=keep),
    }
    pinned = settings.model_copy(update={"inference_min": inference})  # `--inference`: each model's default minimum
    bounds = {name: pinned.bounds_of(name) for name in settings.served}
    for model in settings.served.values():
        if not autoscale and model.min_replicas == 0:  # its MODELS entry may scale to zero, but nothing scales it up
            bounds[model.name] = (1, max(1, bounds[model.name][1]))  # without the autoscaler: its jobs would wait
            log.warning("model %s: min_replicas 0 without the autoscaler: it runs one inference worker", model.name)
        elif not autoscale and bounds[model.name][0] == 0:  # `--inference 0`: the operator runs them (elsewhere)
            log.warning("model %s: no inference worker here (--inference 0 without the autoscaler): its jobs wait "
                        "for workers started apart (`conveyor inference` with this REDIS_URL)", model.name)
    inference_env = {**env, **one_worker_binds(env, sum(high if autoscale else low for low, high in bounds.values()))}
    for model in settings.served.values():  # a pool per model, each worker serving the one its MODEL names
        low, high = bounds[model.name]
        pool = names.inference_pool(settings.key_of(model.name))
        workers[pool] = Pool(pool, cli + ["inference"], {**inference_env, "MODEL": model.path,
                                                          "MODEL_NAME": model.name},
                             low, min_size=low, max_size=high if autoscale else low, grace_s=grace, keep_fds=keep)
    celery_env = {**env, "PYTHONWARNINGS": "ignore:You're running the worker with superuser"}  # as root
    return Pools(traces, Pool("api", cli + ["api"], env, 1, grace_s=10, keep_fds=keep), workers,
                 [Pool("celery", celery_argv(settings), celery_env, 1, grace_s=10, keep_fds=keep)] if celery else [])


def _embedded_redis(settings: Settings, redis_cluster: int, lock: StackLock, env: dict[str, str]
                    ) -> tuple[EmbeddedRedis | None, subprocess.Popen[bytes] | None]:
    """Unless REDIS_URL names one: the stack's own Redis (one redis-server, or a local cluster of `redis_cluster`
    masters) started, with its guard; `env` gains its URL. (None, None) with REDIS_URL set."""
    if settings.redis_url:
        if redis_cluster:
            raise SystemExit("--redis-cluster starts a local cluster: leave REDIS_URL empty")
        return None, None
    # the guard first: from then on Redis outlives the supervisor only until the rest has gone
    guard = subprocess.Popen([sys.executable, "-m", "infra.redis_guard", str(lock.path),
                              str(settings.redis_data_dir / CONNECTION_FILE),
                              str(worker_stop_s(settings.drain_grace_s) + 15)],
                             preexec_fn=preexec_die_with_parent(signal.SIGTERM))
    embedded = EmbeddedRedis(settings, redis_cluster)
    # the CLI (`conveyor keys ...`) and the benchmarks find this stack's Redis in its connection file
    try:
        env.update(embedded.start())
    except RuntimeError as exc:  # (the guard stops whatever of it did start, once this process has gone)
        raise SystemExit(f"the stack's Redis did not start: {exc}") from None
    return embedded, guard


def _require_free_ports(settings: Settings) -> None:
    """Exit saying so when another server listens on PORT (or INTERNAL_PORT)."""
    ports = [(settings.host, settings.port)] + (
        [(settings.internal_host, settings.internal_port_number)] if settings.auth_required else [])
    for host, port in ports:
        if port and not _port_free(host, port):
            raise SystemExit(f"port {port} on {host} is in use (another conveyor, or another server): stop it, or "
                             f"set {'PORT' if port == settings.port else 'INTERNAL_PORT'} to a free one")


def _port_free(host: str, port: int) -> bool:
    """Whether a server could listen on (host, port) now: one already listening there would answer in our stead
    (our API would exit and restart again and again, while `conveyor up` took the other's /readyz for its own)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a closed one's TIME_WAIT is none
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def run_supervisor(settings: Settings, tokenizers: int = 1, inference: int = 1, autoscale: bool = True,
                   celery: bool = True, redis_cluster: int = 0, traces_port: int = 0) -> int:
    stop = threading.Event()

    def _signal(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping the stack", signum)
        stop.set()

    signal.signal(signal.SIGINT, _signal)
    signal.signal(signal.SIGTERM, _signal)

    lock = StackLock(settings.cache_dir)
    _require_free_ports(settings)
    keep = (lock.fd,)
    env = dict(os.environ)
    embedded, guard = _embedded_redis(settings, redis_cluster, lock, env)
    pools = _pools(settings, env, keep, tokenizers, inference, autoscale, celery, traces_port)
    url = f"http://{settings.host}:{settings.port}"
    shown = f"conveyor is up at {url}" + (f", its traces at {phoenix.ui_url(traces_port)}" if traces_port else "")
    try:
        for p in pools.traces:  # first, and answering: the others export to it from their start
            p.reconcile()
            if not phoenix.wait_ready(traces_port, stop=stop):
                log.warning("phoenix: not answering on port %d; spans are dropped until it does", traces_port)
        for p in pools.everything:
            p.reconcile()
        ready = threading.Thread(target=lambda: _wait_ready(url, stop) and print(
            f"{shown}  (Ctrl-C stops it)", flush=True), daemon=True)
        ready.start()
        scaler = (Autoscaler(settings, env["REDIS_URL"],
                             {n: (p.min_size, p.max_size) for n, p in pools.workers.items()}) if autoscale else None)
        state_path = settings.cache_dir / "supervisor.json"
        while not stop.is_set():
            if embedded is not None:
                embedded.revive()
            if scaler is not None:
                for name, target in scaler({n: p.target for n, p in pools.workers.items()}).items():
                    pools.workers[name].target = target
            for p in pools.everything:
                p.reconcile()
            write_state(state_path, url, pools.everything, embedded.pids() if embedded is not None else [])
            stop.wait(1.0)
    finally:
        pools.stop(settings.drain_grace_s)
        if embedded is not None:
            embedded.stop()
        if guard is not None:
            guard.kill()
            guard.wait()
        (settings.cache_dir / "supervisor.json").unlink(missing_ok=True)
        lock.release()
        log.info("stopped")
    return 0
