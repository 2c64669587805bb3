"""Matrix-multiply backends for the runner's linear layers, chosen per device, dtype and row count.

Each backend prepares a weight once (`prepare`) and then multiplies with it (`linear`,
`linear_add` for residual + x @ w.T). See `choose_gemm` for the measurements behind the choice.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F

from gpu_worker.engine.cpu_kernels import PackedGemmKernel, load_packed_gemm, release_threads, supports_packed_gemm

log = logging.getLogger(__name__)


class Gemm:
    """Plain torch matmuls over the weights as loaded."""

    copies_weights = False

    def step(self) -> contextlib.AbstractContextManager[None]:
        """The context an engine step computes in (`PackedGemm`'s: torch's ops on one thread)."""
        return contextlib.nullcontext()

    def prepare(self, w: torch.Tensor) -> torch.Tensor:
        return w

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, w, b)

    def linear_add(self, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + x @ w.T in one call."""
        return torch.addmm(residual, x, w.t())


# oneDNN's brgemm blocks a reduction longer than this in one way for a single row and in another for two or more:
# a row alone would get other bits than among others (every row in float32, ~10% of rows in bfloat16, at K 1,032
# and up; none at 1,024 and below). From two rows on, one blocking at every row count (tested up to 4,130).
ONE_ROW_MAX_K = 1024
# oneDNN's AMX kernels (bfloat16 on Intel Xeon since Sapphire Rapids) compute a call of up to 32 rows one way and a
# longer one another: a row among 33 or more gets other bits than alone (every shape tested, from 33 rows on; at 32
# and below every row count agrees). Calls of at most 32 rows keep a row's bits whatever its batch: a prefill burst
# takes 1.9x its time that way, against 4.5x with oneDNN held to AVX512-BF16 (BENCHMARKS.md, "Batch invariance").
AMX_MAX_ROWS = 32


class OneDnnGemm(Gemm):
    """CPU matmuls on weights reordered once into oneDNN's blocked layout. torch's own CPU bf16
    linear calls the same oneDNN kernel but reorders the weight on every call; reordering once
    makes bf16 GEMMs ~1.5x faster here with bit-identical results. A row's bits do not depend on the
    rows beside it: a single row over a long K is computed as two (ONE_ROW_MAX_K), and with AMX a batch in calls of
    at most `max_rows` (AMX_MAX_ROWS)."""

    copies_weights = True  # the model's own linear layers are emptied once their copies exist

    def __init__(self, batch_hint: int, max_rows: int = 0) -> None:
        self.batch_hint, self.max_rows = batch_hint, max_rows

    # torch.ops resolves its operators at run time: their results are typed Any, named Tensor here
    def prepare(self, w: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), self.batch_hint)
        return out

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if self.max_rows and x.shape[0] > self.max_rows:
            return torch.cat([self._linear(part, w, b) for part in torch.split(x, self.max_rows)])
        return self._linear(x, w, b)

    def linear_add(self, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.max_rows and x.shape[0] > self.max_rows:
            return torch.cat([self._linear_add(part, w, res) for part, res in
                              zip(torch.split(x, self.max_rows), torch.split(residual, self.max_rows), strict=True)])
        return self._linear_add(x, w, residual)

    def _linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        out: torch.Tensor
        if x.shape[0] == 1 and x.shape[1] > ONE_ROW_MAX_K:
            out = torch.ops.mkldnn._linear_pointwise(torch.cat((x, x)), w, b, "none", [], "")[:1]
        else:
            out = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        return out

    def _linear_add(self, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor
        if x.shape[0] == 1 and x.shape[1] > ONE_ROW_MAX_K:
            out = torch.ops.mkldnn._linear_pointwise.binary(torch.cat((x, x)), torch.cat((residual, residual)), w,
                                                             None, "add")[:1]
        else:
            out = torch.ops.mkldnn._linear_pointwise.binary(x, residual, w, None, "add")
        return out


class PackedGemm(Gemm):
    """Our own kernel on weights packed once (csrc/packed_gemm.cpp): as fast as oneDNN's on reordered weights at
    decode's row counts on an idle machine, and its pool's threads claim the output a chunk at a time, so a thread the
    OS lends to another process (the API, the output lane, Redis, a client on the same cores) holds no call up: the
    caller computes the chunk it held (and the thread, back, drops its own), where oneDNN's and OpenMP's static halves
    wait for it at every barrier. A row's bits do not depend on the rows beside it (each row's sums in one order at
    every row count, whichever thread computes them)."""

    copies_weights = True

    def __init__(self, kernel: PackedGemmKernel) -> None:
        self.kernel = kernel

    def step(self) -> contextlib.AbstractContextManager[None]:
        return self.kernel.one_torch_thread()

    def prepare(self, w: torch.Tensor) -> torch.Tensor:
        return self.kernel.pack(w)

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return self.kernel(x, w, b)

    def linear_add(self, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, w, None, residual)


def _onednn_ok(device: torch.device) -> bool:
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def _has_amx() -> bool:
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(check is not None and check())


def choose_gemm(device: torch.device, dtype: torch.dtype, batch_hint: int = 32,
                packed: bool = False) -> tuple[Gemm, Gemm]:
    """(GEMM for the decoder layers, GEMM for the LM head). On CPU with `packed` (CPU_GEMM=packed with CPU_KERNELS),
    our own kernel where the CPU has the dtype's instructions (`PackedGemm`): under load it keeps more of the
    engine's time when other processes share its cores (docs/bench-log.md, "Contention"). Otherwise oneDNN on
    reordered weights at every row count, where the CPU has the dtype's instructions (float32 always). Measured as
    whole decode steps (docs/bench-log.md, "GEMM"): a float32 step at 32 running takes 47 ms with oneDNN's
    reordered weights against 89-98 ms with MKL's packed sgemm and 105 ms with F.linear, although timing each
    weight shape alone (bench/gemm_shapes.py) had favoured MKL; at 1 and 2 rows 16 and 18 ms against F.linear's
    36 and 63 (`bench.engine --step-time 1,2`: F.linear's matrix-vector products, the LM head's above all, are
    5-10x slower). F.linear was kept there once for results bit-identical with transformers' own forward; greedy
    tokens still match its `generate` (tests/gpu_worker/engine)."""
    kernel = load_packed_gemm() if packed and supports_packed_gemm(device, dtype) else None
    if kernel is not None:
        kernel.own_threads()
        ours = PackedGemm(kernel)
        return ours, ours
    if device.type == "cpu":
        release_threads()
    if not _onednn_ok(device):
        return Gemm(), Gemm()
    if dtype == torch.float32:
        onednn = OneDnnGemm(batch_hint)
        return onednn, onednn
    supported = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}[dtype]
    check = getattr(torch.ops.mkldnn, supported, None)
    if check is not None and check():  # the CPU has the instructions (AVX512-BF16 / AMX / AVX512-FP16)
        onednn = OneDnnGemm(batch_hint, AMX_MAX_ROWS if _has_amx() else 0)
        return onednn, onednn
    return Gemm(), Gemm()
