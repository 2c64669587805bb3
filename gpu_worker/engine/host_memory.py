"""Host memory: glibc's malloc told to keep what a CPU step frees, so the next step does not fault it in again.

A CPU step allocates and frees the same large temporaries every time (gathered K/V, attention scores
and probabilities, dtype copies), megabytes each once contexts grow. With glibc's defaults, freeing
them shrinks the heap (or unmaps them) whenever enough is free at its top, and the next step takes
the same pages back from the kernel, zero-filled, one page fault at a time. At 32 decoding rows of
~300 tokens that made a float32 step 243 ms against 66 ms with the settings below
(`python -m bench.engine --step-time 32 --dtypes bfloat16,float32 --prompt-len 300`, BENCHMARKS.md).

The settings are glibc's own tunables (the same as MALLOC_MMAP_THRESHOLD_, MALLOC_TOP_PAD_ and
MALLOC_TRIM_THRESHOLD_ in the environment), set whenever the engine resolves a CPU device (device.py;
idempotent): blocks up to 32 MB come from the heap, the heap grows 64 MB at a time and keeps up to
256 MB free before giving memory back. The process's memory stays flat: at most that much more than
its peak step needs is kept.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("conveyor.engine")

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's malloc.h
SETTINGS = ((M_MMAP_THRESHOLD, 32 * 2**20), (M_TOP_PAD, 64 * 2**20), (M_TRIM_THRESHOLD, 256 * 2**20))


def keep_freed_memory() -> bool:
    """Apply the settings above; False where the C library is not glibc (nothing changes there)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = all(mallopt(param, value) == 1 for param, value in SETTINGS)
    if not ok:
        log.warning("glibc refused a malloc setting; CPU steps may fault memory in again each step")
    return ok
