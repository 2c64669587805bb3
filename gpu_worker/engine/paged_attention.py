"""Decode attention over the paged KV cache in place (csrc/paged_attention.cpp), on CPU: each decode row reads
its own blocks up to its own length, where the portable path gathers every row's K/V into a padded copy first
and then runs SDPA over it (three passes over memory against one).

The kernel is plain C++ behind a C ABI, compiled on first use for this CPU (`g++ -O3 -march=native`, under a
second) into a cache keyed by its source, flags and the CPU's feature flags, and loaded through ctypes (the call
releases the GIL). It runs its rows on torch's OpenMP runtime, with torch's thread count. Where no compiler is
found, the build fails, or a shape has no kernel (head_dim other than 16/32/64/128/256), the model keeps the
gather + SDPA path: `load_paged_decode()` returns None and says why once in the log."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-std=c++17", "-shared", "-fPIC")
HEAD_DIMS = (16, 32, 64, 128, 256)
_ARGS = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
         ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int,
         ctypes.c_float, ctypes.c_void_p, ctypes.c_int)


def cache_dir() -> Path:
    """Where built kernels are kept: $CONVEYOR_KERNEL_CACHE, else `kernels/` in the service's cache (CONVEYOR_CACHE,
    else $XDG_CACHE_HOME/conveyor, else ~/.cache/conveyor: where the model is kept too)."""
    if os.environ.get("CONVEYOR_KERNEL_CACHE"):
        return Path(os.environ["CONVEYOR_KERNEL_CACHE"])
    root = os.environ.get("CONVEYOR_CACHE")
    if not root:
        root = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "conveyor")
    return Path(root) / "kernels"


def _cpu_flags() -> bytes:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.encode()
    except OSError:
        pass
    return b""


def build(compiler: str | None = None) -> Path:
    """The kernel's shared library for this CPU, compiled unless already in the cache. Raises on failure."""
    cxx = compiler or os.environ.get("CXX") or "g++"
    if shutil.which(cxx) is None:
        raise FileNotFoundError(f"no C++ compiler ({cxx})")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + _cpu_flags()).hexdigest()[:16]
    out = cache_dir() / f"paged_attention-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)  # built aside, then renamed: workers may race
    os.close(fd)
    try:
        subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", tmp], check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, out)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"{cxx} failed: {e.stderr.strip()[-2000:]}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


class PagedDecode:
    """The loaded kernel: `__call__` attends one query per row against the row's own cached tokens."""

    def __init__(self, path: Path) -> None:
        self._fn = ctypes.CDLL(str(path)).conveyor_paged_decode
        self._fn.argtypes = _ARGS
        self._fn.restype = ctypes.c_int

    def __call__(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor, block_size: int) -> torch.Tensor:
        """q [rows, H, D]; kc, vc a layer's [KV, slots, D] (float32 or bfloat16, contiguous); tables [rows, blocks]
        and lens [rows] int32 (a row reads its first lens[r] tokens, lens[r] >= 1). Out [rows, H, D] in q's dtype."""
        rows, H, D = q.shape
        KV, slots, _ = kc.shape
        qf = q.float().contiguous()
        out = torch.empty_like(qf)
        rc = self._fn(qf.data_ptr(), kc.data_ptr(), vc.data_ptr(), int(kc.dtype == torch.bfloat16), tables.data_ptr(),
                      tables.shape[1], lens.data_ptr(), rows, H, KV, D, slots, block_size, D**-0.5, out.data_ptr(),
                      torch.get_num_threads())
        if rc:
            raise ValueError(f"no paged decode kernel for {H} heads over {KV} KV heads of {D}")
        return out if q.dtype == torch.float32 else out.to(q.dtype)


def supports_paged_decode(device: torch.device, dtype: torch.dtype, num_heads: int, kv_heads: int,
                          head_dim: int) -> bool:
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and head_dim in HEAD_DIMS
            and num_heads % kv_heads == 0 and num_heads // kv_heads <= 64)


@cache
def load_paged_decode() -> PagedDecode | None:
    """The kernel, built if need be; None (logged once) where it cannot be had."""
    try:
        return PagedDecode(build())
    except Exception as e:  # noqa: BLE001 - any failure means the portable path
        log.warning("paged decode attention unavailable, using gather + SDPA: %s", e)
        return None
