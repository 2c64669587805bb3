"""A child process dies with its parent, even when the parent is SIGKILLed (Linux's
PR_SET_PDEATHSIG; elsewhere nothing happens). Threads carry their names into the kernel
(PR_SET_NAME), so `top -H` and /proc/<pid>/task/*/comm tell a worker's lanes apart. A process that
loaded torch and transformers exits without the interpreter's final collections (`exit_quickly`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import signal
import sys
from collections.abc import Callable
from typing import NoReturn

LANE_STOP_S = 10  # how long an inference worker's output lane may take to write what it holds at exit (twice: the
# stop's hand-over, then its join)


def worker_stop_s(drain_grace_s: float) -> float:
    """The longest a worker may take to stop once told: its drain, then its output lane's stop."""
    return drain_grace_s + 2 * LANE_STOP_S


PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
_prctl: Callable[..., int] | None
try:
    _prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
except (OSError, AttributeError):
    _prctl = None


def die_with_parent(sig: int = signal.SIGTERM, parent_pid: int | None = None) -> None:
    """Ask the kernel to send `sig` when the parent exits. If the parent is already gone (it died
    before this call), exit now. Called in the child, or as a Popen preexec_fn (load-free: the
    libc handle is resolved at import)."""
    if _prctl is None:
        return
    _prctl(PR_SET_PDEATHSIG, sig)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def preexec_die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A preexec_fn for subprocess.Popen: the child gets `sig` when this process dies."""
    parent = os.getpid()
    return lambda: die_with_parent(sig, parent)


def name_thread(name: str) -> None:
    """Name the calling thread for the kernel (at most 15 bytes are kept)."""
    if _prctl is not None:
        _prctl(PR_SET_NAME, name.encode()[:15])


def named(name: str, target: Callable[[], object]) -> Callable[[], None]:
    """`target`, run under a kernel-visible thread name: for threading.Thread(target=...)."""
    def run() -> None:
        name_thread(name)
        target()
    return run


def exit_quickly(code: int | None = 0) -> NoReturn:
    """`sys.exit(code)` after `gc.freeze()`: the interpreter's teardown then runs no collections over every
    object torch and transformers made (~1 s of CPU for a worker; a stack stops that much sooner). Only for
    a process whose work is done: its buffers are flushed and its files closed as by sys.exit."""
    gc.freeze()
    sys.exit(code)
