"""A process told to stop while it starts stops, even as its container's PID 1.

In a container whose command is `conveyor ...` (the image's entrypoint) the process is its PID namespace's init, and
the kernel drops any signal that init has no handler for: a SIGTERM before a role's own handler is installed (an API
importing, a worker loading its model) was lost, and the pod waited out its whole grace period to be killed. Each
role runs here as PID 1 of a namespace of its own (`unshare --pid`) and is told to stop from its first moments."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import redis

from shared import names
from tests.conftest import ROOT


def _namespaces() -> bool:
    """Whether this machine lets a process start as PID 1 of a PID namespace of its own (root, unshare, no sandbox
    that forbids it)."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=30)
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(not _namespaces(), reason="needs a PID namespace of its own (root, unshare)")


# what the Celery containers run (infra/k8s/celery.yaml), with a schedule file of the test's own
CELERY = {"celery-worker": ["celery", "-A", "workers.celery_app", "worker", "--loglevel=INFO", "--concurrency=2"],
          "celery-beat": ["celery", "-A", "workers.celery_app", "beat", "--loglevel=INFO"]}


def _as_init(argv: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[bytes], psutil.Process]:
    """`conveyor ARGV` as PID 1 of a new PID namespace: the unshare process and the role's own (seen from here)."""
    outer = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", sys.executable, "-m",
                              "infra.cli", *argv], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while not (children := psutil.Process(outer.pid).children()):
        assert time.monotonic() < deadline and outer.poll() is None, "the role never started"
        time.sleep(0.005)
    return outer, children[0]


@pytest.mark.parametrize("role", ["api", "tokenizer", "inference", *CELERY])
def test_a_sigterm_while_starting_stops_the_role_as_pid_1(role: str, redis_server, tiny_model_dir: str,  # type: ignore[no-untyped-def]
                                                          tmp_path: Path) -> None:
    url = redis_server.url.rsplit("/", 1)[0] + "/12"
    r = redis.Redis.from_url(url)
    r.flushdb()
    env = {**os.environ, "REDIS_URL": url, "MODEL": tiny_model_dir, "PORT": "0", "LOG_LEVEL": "INFO"}
    argv = [*CELERY[role], f"--schedule={tmp_path / 'beat'}"] if role == "celery-beat" else CELERY.get(role, [role])
    outer, init = _as_init(argv, env)
    try:
        # told again and again from its first moments, as a kubelet is not: one SIGTERM sent before the
        # interpreter has run any of conveyor's code is lost whatever conveyor does
        deadline = time.monotonic() + 30
        while outer.poll() is None:
            assert time.monotonic() < deadline, f"{role} as PID 1 ignored SIGTERM while starting"
            try:
                init.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
            time.sleep(0.05)
        err = outer.stderr.read().decode() if outer.stderr else ""
        # unshare exits as its child did: 128 + SIGTERM, the code of a process ended by it (no traceback)
        assert outer.returncode == 128 + signal.SIGTERM, (outer.returncode, err[-3000:])
        # (a SIGTERM landing in a weakref callback is printed as ignored there: the next one, or the fallback's
        # exit, ends the process)
        err = re.sub(r"Exception ignored in: .*?\nSystemExit: 143\n", "", err, flags=re.S)
        assert "Traceback" not in err, err[-3000:]
        assert "ready" not in err and "Uvicorn running" not in err and "beat: Starting" not in err, \
            f"{role} went on to start: {err[-3000:]}"
        assert not [k for k in r.scan_iter(f"{names.PREFIX}:*workers*")], "a worker registered"
    finally:
        if outer.poll() is None:
            outer.kill()
            outer.wait()
