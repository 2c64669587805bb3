"""The engine's compiled CPU kernels (csrc/), and their loader.

- `PagedDecode` (csrc/paged_attention.cpp): decode attention over the paged KV cache in place, each decode row
  reading its own blocks up to its own length, where the portable path gathers every row's K/V into a padded copy
  first and runs SDPA over it (three passes over memory against one).
- `PagedPrefill` (csrc/prefill_attention.cpp): prefill attention over the paged cache in place, every chunk of a
  step at once, flash style (online softmax: no scores written, no padded batch, no gathered copy), float32 on
  AVX512F (16 lanes) or AVX2 + FMA (8), bfloat16 on AVX512-BF16 dot products; where the other paths attend chunk
  by chunk through SDPA (float32) or pad the chunks into one batch of matmuls over K/V gathered from the cache
  (bfloat16). Where the CPU has neither AVX512 nor AVX2 it declines to load.
- `LayerOps` (csrc/layer_ops.cpp): a layer's elementwise steps in one pass each (RMSNorm; SiLU(gate) * up; RoPE on
  q and k with the new K/V written to its cache slots; batched prefill's causal softmax), where torch takes several
  ops, each with its overhead.
- `PackedGemmKernel` (csrc/packed_gemm.cpp): the linear layers' x @ W.T on weights packed once (float32 on
  AVX512F, bfloat16 on AVX512-BF16), on a pool of threads that claim a call's work a chunk at a time; a chunk whose
  thread the OS takes away before it is done is computed by the caller instead.

Each source is plain C++ behind a C ABI, compiled on first use for this CPU (`g++ -O3 -march=native`, 0.4-3 s
each) into a cache keyed by its source, the flags and the CPU's feature flags, and loaded through ctypes (a call
releases the GIL). Their parallel loops (csrc/parallel.h) run on the packed GEMM's pool while it owns the process's
compute threads (`own_threads`, CPU_GEMM=packed; torch's own ops then run on one thread while a step computes), else
on torch's OpenMP runtime with torch's thread count. Where no
compiler is found or a build fails, `load_*` returns None (logged once) and the model keeps its torch path
(CPU_KERNELS=false: always)."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import torch

from gpu_worker.cpu_affinity import compute_cpus

if TYPE_CHECKING:
    from _ctypes import CFuncPtr

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
# -ffast-math compiles only (vectorised exp, reassociated sums); linked with it, gcc adds crtfastmath.o, which
# sets flush-to-zero for the whole process on load: torch's and numpy's subnormals would vanish
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-std=c++17", "-fPIC")
LINK = ("-shared", "-fopenmp")
# added to FLAGS: the build an AVX2-only CPU gets, made on a CPU with AVX512 too (tests and benchmarks run it there)
AVX2_ONLY = ("-mno-avx512f",)
HEAD_DIMS = (16, 32, 64, 128, 256)  # the paged decode kernel's
PREFILL_HEAD_DIMS = (16, 32, 64, 128, 256)  # the paged prefill kernel's
_p, _i, _i64, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
K = TypeVar("K", "PagedDecode", "PagedPrefill", "LayerOps", "PackedGemmKernel")


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


def build(name: str, compiler: str | None = None, extra: tuple[str, ...] = (), cache: Path | None = None) -> Path:
    """csrc/<name>.cpp as a shared library for this CPU (`extra` flags after FLAGS), compiled unless already in the
    cache (`cache`, else `cache_dir()`) with `compiler` (else $CXX, else g++). Raises on failure."""
    source = CSRC / f"{name}.cpp"
    flags = FLAGS + extra
    headers = b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))
    key = hashlib.sha256(source.read_bytes() + headers + " ".join(flags + LINK).encode()
                         + _cpu_flags()).hexdigest()[:16]
    out = (cache or cache_dir()) / f"{name}-{key}.so"
    if out.exists():  # built before, here or by another worker sharing the cache: no compiler needed
        return out
    cxx = compiler or os.environ.get("CXX") or "g++"
    if shutil.which(cxx) is None:
        raise FileNotFoundError(f"no C++ compiler ({cxx})")
    out.parent.mkdir(parents=True, exist_ok=True)
    # workers starting together on a fresh host build it once: the first holds the lock, the others then find it
    with open(out.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            _compile(cxx, flags, source, out)
    return out


def _compile(cxx: str, flags: tuple[str, ...], source: Path, out: Path) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)  # built aside, then renamed: a reader sees it whole
    os.close(fd)
    obj = tmp[:-3] + ".o"
    try:
        for argv in ([cxx, *flags, "-c", str(source), "-o", obj], [cxx, *LINK, obj, "-o", tmp]):
            subprocess.run(argv, check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, out)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"{cxx} failed: {e.stderr.strip()[-2000:]}") from e
    finally:
        for path in (tmp, obj):
            if os.path.exists(path):
                os.unlink(path)


_opened: list[ctypes.CDLL] = []  # every kernel library loaded, to install the pool in
_pool: list[int] = []  # the pool's run function (packed_gemm's conveyor_pool_run) while the pool owns the threads


def _open(path: Path) -> ctypes.CDLL:
    """A kernel library, its parallel loops on the pool if one is in use (csrc/parallel.h)."""
    lib = ctypes.CDLL(str(path))
    _opened.append(lib)
    if _pool:
        lib.conveyor_set_pool(ctypes.c_void_p(_pool[0]))
    return lib


def _function(lib: ctypes.CDLL, name: str, args: tuple[type[ctypes._SimpleCData[Any]], ...],
              restype: type[ctypes._SimpleCData[Any]] | None = None) -> CFuncPtr:
    fn: CFuncPtr = getattr(lib, name)
    fn.argtypes, fn.restype = args, restype
    return fn


class PagedDecode:
    """Decode attention read in place: `__call__` attends one query per row to the row's own cached tokens."""

    def __init__(self, path: Path) -> None:
        self._fn = _function(_open(path), "conveyor_paged_decode",
                             (_p, _p, _p, _i, _p, _i, _p, _i, _i, _i, _i, _i64, _i, _f, _p, _i), _i)

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


class PagedPrefill:
    """Prefill attention read in place: `__call__` attends every chunk's queries causally to its sequence's cached
    tokens and its own. `dtypes`: what this CPU's build takes (float32 with AVX512F or AVX2 + FMA, bfloat16 with
    AVX512-BF16); `lanes`: its vectors' float lanes (16 AVX512, 8 AVX2)."""

    def __init__(self, path: Path) -> None:
        lib = _open(path)
        bits = _function(lib, "conveyor_paged_prefill_dtypes", (), _i)()
        self.dtypes = frozenset(dt for bit, dt in ((1, torch.float32), (2, torch.bfloat16)) if bits & bit)
        self.lanes: int = _function(lib, "conveyor_paged_prefill_lanes", (), _i)()
        if not self.dtypes:
            raise RuntimeError("this CPU has neither AVX512 nor AVX2 + FMA")
        self._workspace = _function(lib, "conveyor_paged_prefill_workspace", (_p, _p, _i, _i, _i, _i), _i64)
        self._fn = _function(lib, "conveyor_paged_prefill", (_p, _i64, _p, _p, _i, _p, _i, _p, _p, _p, _i, _i, _i,
                                                             _i, _i64, _i, _f, _p, _p, _i), _i)

    def workspace(self, starts: torch.Tensor, lengths: torch.Tensor, kv_heads: int, head_dim: int,
                  dtype: torch.dtype) -> int:
        """int32 elements of workspace a call over these chunks needs (their K/V packed for the dot products)."""
        elements: int = self._workspace(starts.data_ptr(), lengths.data_ptr(), starts.numel(), kv_heads, head_dim,
                                        int(dtype == torch.bfloat16))
        return elements

    def __call__(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, chunks: PrefillChunks,
                 block_size: int, out: torch.Tensor) -> torch.Tensor:
        """q [rows, H, D] (each row's heads contiguous; a view into qkv is fine); kc, vc a layer's [KV, slots, D]
        in q's dtype; `chunks` the step's prefill chunks, their rows in order; out [rows, H, D] contiguous.
        Returns out."""
        rows, H, D = q.shape
        KV, slots, _ = kc.shape
        assert q.stride(2) == 1 and q.stride(1) == D and out.is_contiguous() and kc.dtype == q.dtype == out.dtype
        rc = self._fn(q.data_ptr(), q.stride(0), kc.data_ptr(), vc.data_ptr(), int(q.dtype == torch.bfloat16),
                      chunks.tables.data_ptr(), chunks.tables.shape[1], chunks.starts.data_ptr(),
                      chunks.lengths.data_ptr(), chunks.offsets.data_ptr(), chunks.starts.numel(), H, KV, D, slots,
                      block_size, D**-0.5, out.data_ptr(), chunks.work.data_ptr(), torch.get_num_threads())
        if rc:
            raise ValueError(f"no paged prefill kernel for {q.dtype}, {H} heads over {KV} KV heads of {D}")
        return out


class PrefillChunks(NamedTuple):
    """A step's prefill chunks as the paged prefill kernel reads them (int32 tensors): each chunk's sequence's block
    table (padded with the null block), its first position, its token count and its first row; and the workspace
    every layer's call reuses (at least `PagedPrefill.workspace` int32 elements)."""
    tables: torch.Tensor  # [chunks, blocks]
    starts: torch.Tensor  # [chunks]
    lengths: torch.Tensor
    offsets: torch.Tensor
    work: torch.Tensor


class LayerOps:
    """A layer's elementwise steps, each one pass over contiguous float32 or bfloat16 tensors."""

    def __init__(self, path: Path) -> None:
        lib = _open(path)
        self._rms = _function(lib, "conveyor_rms_norm", (_p, _p, _p, _i, _i64, _i, _f, _i))
        self._silu = _function(lib, "conveyor_silu_mul", (_p, _p, _i, _i64, _i, _i))
        self._rope = _function(lib, "conveyor_rope_and_cache", (_p, _p, _p, _p, _p, _p, _p, _i, _i64, _i, _i, _i,
                                                                _i64, _i), _i)
        self._softmax = _function(lib, "conveyor_causal_softmax", (_p, _p, _i, _i64, _i, _i, _i, _i, _i, _i))

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """x [N, C] -> x / rms(x) * w, rounded to x's dtype before the weight as transformers' RMSNorm does."""
        out = torch.empty_like(x)
        self._rms(x.data_ptr(), w.data_ptr(), out.data_ptr(), int(x.dtype == torch.bfloat16), x.shape[0], x.shape[1],
                  eps, torch.get_num_threads())
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [N, 2I] (gate, then up) -> silu(gate) * up, [N, I]."""
        n, two_i = gate_up.shape
        out = gate_up.new_empty(n, two_i // 2)
        self._silu(gate_up.data_ptr(), out.data_ptr(), int(gate_up.dtype == torch.bfloat16), n, two_i // 2,
                   torch.get_num_threads())
        return out

    def rope_and_cache(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                       slots: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, num_heads: int) -> None:
        """qkv [N, H + 2 KV, D]: RoPE on q and k in place (cos, sin: [positions, D] tables, x * cos + roll(x, D/2) *
        sin), and each token's k and v written to its slot (int64 `slots`) of kc, vc ([KV, slots, D])."""
        n, heads, d = qkv.shape
        kv, cache_slots, _ = kc.shape
        rc = self._rope(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), slots.data_ptr(),
                        kc.data_ptr(), vc.data_ptr(), int(qkv.dtype == torch.bfloat16), n, num_heads, kv, d,
                        cache_slots, torch.get_num_threads())
        if rc:
            raise ValueError(f"no RoPE kernel for head_dim {d}")


    def causal_softmax_(self, scores: torch.Tensor, starts: torch.Tensor, row0: int, kv_heads: int,
                        group: int) -> torch.Tensor:
        """In place, over a block of a padded prefill batch's scores [chunks * KV, G * rows, keys] (contiguous): query
        row i of chunk b, at position starts[b] + row0 + i (int64 `starts`), softmax over keys 0 .. its position,
        zeros past it. Returns `scores`."""
        bk, grows, keys = scores.shape
        self._softmax(scores.data_ptr(), starts.data_ptr(), int(scores.dtype == torch.bfloat16), bk // kv_heads,
                      kv_heads, group, grows // group, keys, row0, torch.get_num_threads())
        return scores


class PackedGemmKernel:
    """x @ W.T (+ bias, + residual) on weights packed once (`pack`), on the library's pool of threads, which then
    runs the other kernels' parallel loops too (`own_threads`)."""

    PANEL = 32  # output columns per packed panel

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        self._pack = _function(lib, "conveyor_gemm_pack", (_p, _i, _i, _i, _p))
        self._gemm = _function(lib, "conveyor_gemm", (_p, _i64, _p, _p, _p, _p, _i64, _i, _i, _i, _i), _i)
        self._threads = _function(lib, "conveyor_gemm_threads", (_i,), _i)
        self._spin = _function(lib, "conveyor_gemm_spin", (ctypes.c_long,))
        self._stolen = _function(lib, "conveyor_pool_stolen", (), ctypes.c_uint64)
        self._late = _function(lib, "conveyor_pool_late", (), ctypes.c_uint64)
        self._stall_next = _function(lib, "conveyor_pool_stall_next", (ctypes.c_uint64,))
        # the inputs of calls whose chunks were taken from pool threads the OS had taken away: those threads may
        # still read them, until each is back and done (`_late` reaches `_stolen`)
        self._held: list[tuple[torch.Tensor | None, ...]] = []
        run = ctypes.cast(lib.conveyor_pool_run, ctypes.c_void_p).value
        assert run is not None  # a function's address
        self._run: int = run
        self.threads = 1

    def own_threads(self) -> None:
        """The process's compute threads to the pool: as many as torch had (this one and the rest its own, started
        the first time), and every kernel's parallel loops on it. Its threads wait for the next call spinning
        (`pool_spin`) before they sleep. `release_threads` gives them back; `one_torch_thread` keeps torch's own ops
        off them while the engine computes."""
        if _pool:
            return
        if self.threads == 1:
            self._spin(pool_spin(os.environ))
            self.threads = torch.get_num_threads()
            cpus = compute_cpus()
            if cpus:  # bound as OpenMP would bind its team: this thread on the first core, the pool's on the next
                os.sched_setaffinity(0, {cpus[0]})
            self._threads(self.threads)
            if cpus:
                for i, tid in enumerate(_threads_named(b"conveyor-pool"), start=1):
                    os.sched_setaffinity(tid, {cpus[i % len(cpus)]})
        _pool.append(self._run)
        for lib in _opened:
            lib.conveyor_set_pool(ctypes.c_void_p(self._run))

    @contextlib.contextmanager
    def one_torch_thread(self) -> Iterator[None]:
        """torch's own ops on this thread alone while inside (an engine step), so that no OpenMP team spins beside
        the pool; torch's thread count as it was after, for whatever else the process computes (a benchmark's
        other contenders, a test's reference)."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def pack(self, w: torch.Tensor) -> torch.Tensor:
        """w [N, K] -> the same shape over memory in panels of 32 output columns (bfloat16: pairs of a column's
        consecutive inputs), padded with zeros to whole panels (and an even K): read only by this GEMM."""
        n, k = w.shape
        w = w.detach().contiguous()
        packed = torch.empty(-(-n // self.PANEL) * self.PANEL * (k + k % 2), dtype=w.dtype)
        self._pack(w.data_ptr(), n, k, int(w.dtype == torch.bfloat16), packed.data_ptr())
        return packed.as_strided((n, k), (k, 1))

    def stolen(self) -> int:
        """Chunks a caller computed itself because the pool thread that held them had not finished them (the OS
        took it away): each a wait of up to a time slice saved."""
        return int(self._stolen())

    def stall_next(self, ns: int) -> None:
        """The next chunk a pool thread takes in a GEMM call waits `ns` first, once, as if the OS took it away
        (tests)."""
        self._stall_next(ns)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] (rows may be strided) @ w.T [+ bias [N]] [+ residual [M, N]], w from `pack`; x's dtype."""
        m, k = x.shape
        n = w.shape[0]
        if x.stride(1) != 1:
            x = x.contiguous()
        if residual is not None:
            residual = residual.contiguous()
        y = x.new_empty(m, n)
        if self._gemm(x.data_ptr(), x.stride(0), w.data_ptr(), None if bias is None else bias.data_ptr(),
                      None if residual is None else residual.data_ptr(), y.data_ptr(), n, m, n, k,
                      int(x.dtype == torch.bfloat16)):
            self._held.append((x, w, bias, residual))
        if self._held and self._late() == self._stolen():
            self._held.clear()
        return y


def supports_paged_decode(device: torch.device, dtype: torch.dtype, num_heads: int, kv_heads: int,
                          head_dim: int) -> bool:
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and head_dim in HEAD_DIMS
            and num_heads % kv_heads == 0 and num_heads // kv_heads <= 64)


def supports_paged_prefill(device: torch.device, dtype: torch.dtype, num_heads: int, kv_heads: int,
                           head_dim: int) -> bool:
    """The shapes the kernel takes; whether this CPU takes `dtype` is the loaded kernel's (`PagedPrefill.dtypes`)."""
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and head_dim in PREFILL_HEAD_DIMS
            and num_heads % kv_heads == 0)


def supports_layer_ops(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and head_dim <= 512 and head_dim % 2 == 0


def _load(kind: type[K], source: str, instead: str, **how: Any) -> K | None:
    """`kind` over the library `build(source, **how)` gives; None (logged) where it cannot be had."""
    try:
        return kind(build(source, **how))
    except Exception as e:  # noqa: BLE001 - any failure means torch's path
        log.warning("CPU kernels %s unavailable, using %s: %s", source, instead, e)
        return None


@cache
def load_paged_decode() -> PagedDecode | None:
    """The paged decode kernel, built if need be; None (logged once) where it cannot be had."""
    return _load(PagedDecode, "paged_attention", "gather + SDPA")


@cache
def load_paged_prefill() -> PagedPrefill | None:
    """The paged prefill kernel, built if need be; None (logged once) where it cannot be had (no compiler, neither
    AVX512 nor AVX2)."""
    return _load(PagedPrefill, "prefill_attention", "SDPA per chunk, or batched matmuls over gathered K/V")


def build_paged_prefill_avx2() -> PagedPrefill | None:
    """The paged prefill kernel as an AVX2-only CPU builds it (8 lanes, float32), built here with AVX512 off, for
    tests and benchmarks; None where this CPU's own build already is that one (no AVX512) or it lacks AVX2 + FMA."""
    native = load_paged_prefill()
    flags = _cpu_flags().split()
    if native is None or native.lanes != 16 or b"avx2" not in flags or b"fma" not in flags:
        return None
    return PagedPrefill(build("prefill_attention", extra=AVX2_ONLY))


def _threads_named(name: bytes) -> list[int]:
    """This process's threads of that name, by thread id."""
    tids = []
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            if (task / "comm").read_bytes().strip() == name:
                tids.append(int(task.name))
    return sorted(tids)


DEFAULT_SPIN = 500  # pauses (~25 ns each here)


def pool_spin(env: Mapping[str, str]) -> int:
    """Pauses a pool thread (and a caller waiting for one) spins before it sleeps: GOMP_SPINCOUNT where set (the
    knob of the OpenMP team the pool stands in for); else 20,000 (~0.5 ms) under OMP_WAIT_POLICY=ACTIVE, none under
    PASSIVE, and by default `DEFAULT_SPIN` (~12 us): enough to be awake for the next call of a layer (a few us of
    Python apart), so the pool's thread does not join each call a wake-up late (a bfloat16 decode step at 32 rows
    28.8 -> 26.5 ms in process), and too short to hold a core the stack's other processes and its clients want
    between steps (20,000 served 4-7% fewer tokens than none under guidellm on 2 cores; docs/bench-log.md,
    "Contention")."""
    count = env.get("GOMP_SPINCOUNT", "").strip()
    if count.isdigit():
        return min(int(count), 2**62)
    policy = env.get("OMP_WAIT_POLICY", "").upper()
    return 20000 if policy == "ACTIVE" else 0 if policy == "PASSIVE" else DEFAULT_SPIN


def release_threads() -> None:
    """The kernels' loops back on OpenMP's team (an engine on oneDNN after one on the packed GEMM, in one process)."""
    if not _pool:
        return
    _pool.clear()
    for lib in _opened:
        lib.conveyor_set_pool(None)


def supports_packed_gemm(device: torch.device, dtype: torch.dtype) -> bool:
    """The packed GEMM's dtypes on this CPU: float32 with AVX512F, bfloat16 with AVX512-BF16."""
    flags = _cpu_flags().split()
    need = {torch.float32: b"avx512f", torch.bfloat16: b"avx512_bf16"}.get(dtype)
    return device.type == "cpu" and need is not None and need in flags


@cache
def load_packed_gemm() -> PackedGemmKernel | None:
    """The packed GEMM, built if need be (once per process: its pool is the process's); None (logged once) where it
    cannot be had. The caller hands it the threads (`own_threads`)."""
    return _load(PackedGemmKernel, "packed_gemm", "oneDNN", extra=("-fno-fast-math",))


@cache
def load_layer_ops() -> LayerOps | None:
    """The layer ops, built if need be; None (logged once) where they cannot be had."""
    return _load(LayerOps, "layer_ops", "torch's ops")
