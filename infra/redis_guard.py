"""The embedded redis-server is the last process of a stack to go, even when the supervisor is
killed outright: draining workers must still be able to record what they finish.

The supervisor starts this guard first, as a child that gets SIGTERM when the supervisor dies
(PR_SET_PDEATHSIG), and starts redis-server without that signal. On SIGTERM the guard waits until
the stack lock is free (every child of the supervisor holds it, inherited; the guard and
redis-server do not), at most `grace_s`, then stops the redis-server processes named in the
connection file (SIGTERM: each flushes its append-only file). When the stack stops normally, the supervisor
stops redis-server itself and then kills the guard.

    python -m infra.redis_guard <lock file> <connection file> <grace seconds>
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
import time
from pathlib import Path


def _alive(pid: int) -> bool:
    """Running (a zombie, waiting for a parent that reaps it, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


def wait_for_lock(lock_path: Path, deadline: float) -> bool:
    """Wait until nobody holds the stack lock (True), or the deadline passes (False)."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.1)
    finally:
        os.close(fd)  # releases the lock too


def stop_server(connection_file: Path, timeout: float = 10.0) -> None:
    """SIGTERM the redis-server processes of the connection file ("pids", else "pid"), SIGKILL
    those that linger."""
    try:
        info = json.loads(connection_file.read_text())
        pids = [int(p) for p in info.get("pids") or [info["pid"]]]
    except (OSError, ValueError, KeyError, TypeError):
        return
    mine = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"redis-server" not in f.read():
                    continue  # a stale file: that pid is someone else's now
            os.kill(pid, signal.SIGTERM)
            mine.append(pid)
        except (OSError, ProcessLookupError):
            continue
    deadline = time.monotonic() + timeout
    while any(_alive(pid) for pid in mine) and time.monotonic() < deadline:
        time.sleep(0.05)
        for pid in mine:  # redis 7 refuses one SIGTERM while it writes its first append-only file
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
    for pid in mine:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def main(argv: list[str]) -> int:
    lock_path, connection_file, grace_s = Path(argv[0]), Path(argv[1]), float(argv[2])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the supervisor, which stops everything
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    signal.sigwait({signal.SIGTERM})
    wait_for_lock(lock_path, time.monotonic() + grace_s)
    stop_server(connection_file)
    connection_file.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
