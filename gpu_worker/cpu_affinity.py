"""Where the inference worker's compute threads run on a CPU host that runs one inference worker
(`CPU_BIND_THREADS=true`): the engine's OpenMP threads bound one to a core (`OMP_PROC_BIND=true`,
`OMP_PLACES=cores`), as vLLM-CPU binds its own. Unbound, the OS moves a compute thread onto a core another process
is using, and every other thread waits for it at the step's next barrier. Measured on 2 cores (docs/bench-log.md,
"Binding"): under guidellm at 32 streams the whole service made 5-12% more tokens per second with 5-10% less CPU
per token; the engine beside a process keeping half a core busy, 9-19% more. Off by default: workers bound alike
share the same cores' first and second threads: the test suite's many stacks on 2 cores took 358 s with it, 247-303 s
without (runs an hour apart, on a machine that slowed meanwhile).

libgomp reads these when torch loads and pins the loading thread to the first core; what that thread starts
afterwards inherits its mask. So the worker notes its mask first (`bind_compute_threads`), and the processes it
starts take it back (`release`): the output lane is not confined to the engine's first core. The packed GEMM's pool
(CPU_GEMM=packed) takes OpenMP's place and binds alike (`compute_cpus`): the engine thread on the first core, each
of the pool's threads on the next. An operator's own OMP_PROC_BIND / OMP_PLACES win; `CPU_BIND_THREADS=false`
leaves placement to the OS. Torch-free: it runs before torch loads."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

MASK_ENV = "CONVEYOR_CPU_MASK"  # the worker's CPUs before torch pinned it, for the processes it starts


def bind_compute_threads(enabled: bool, device: str) -> bool:
    """Before torch loads, on a CPU host: have libgomp bind the compute threads to cores. Returns whether it will."""
    gpu_host = device.startswith("cuda") or (device == "auto" and Path("/dev/nvidiactl").exists())
    if not enabled or gpu_host or not hasattr(os, "sched_getaffinity"):
        return False
    os.environ[MASK_ENV] = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    os.environ.setdefault("OMP_PROC_BIND", "true")
    os.environ.setdefault("OMP_PLACES", "cores")
    return True


def compute_cpus() -> list[int]:
    """The CPUs the compute threads take one each, in order, where OpenMP is told to bind them (OMP_PROC_BIND, set by
    `bind_compute_threads` or the operator): the worker's CPUs before torch pinned it; [] where nothing binds. For the
    packed GEMM's pool, which takes OpenMP's place (gpu_worker/engine/cpu_kernels.py)."""
    if os.environ.get("OMP_PROC_BIND", "").lower() not in ("true", "close", "spread", "master", "primary"):
        return []
    mask = os.environ.get(MASK_ENV)
    return [int(c) for c in mask.split(",")] if mask else sorted(os.sched_getaffinity(0))


def release() -> None:
    """In a process the worker started: run on the CPUs the worker had before torch pinned it."""
    mask = os.environ.get(MASK_ENV)
    if mask:
        with contextlib.suppress(OSError, ValueError):
            os.sched_setaffinity(0, {int(c) for c in mask.split(",")})
