"""Matrix-multiply backends for the runner's linear layers, chosen per device, dtype and row count.

Each backend prepares a weight once (`prepare`) and then multiplies with it (`linear`,
`linear_add` for residual + x @ w.T). See `choose_gemm` for the measurements behind the choice.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


class Gemm:
    """Plain torch matmuls over the weights as loaded."""

    copies_weights = False

    def prepare(self, w: torch.Tensor) -> torch.Tensor:
        return w

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, w, b)

    def linear_add(self, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + x @ w.T in one call."""
        return torch.addmm(residual, x, w.t())


class OneDnnGemm(Gemm):
    """CPU matmuls on weights reordered once into oneDNN's blocked layout. torch's own CPU bf16
    linear calls the same oneDNN kernel but reorders the weight on every call; reordering once
    makes bf16 GEMMs ~1.5x faster here with bit-identical results."""

    copies_weights = True  # the model's own linear layers are emptied once their copies exist

    def __init__(self, batch_hint: int) -> None:
        self.batch_hint = batch_hint

    def prepare(self, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), self.batch_hint)

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")

    def linear_add(self, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, w, None, "add")


class SplitGemm(Gemm):
    """float32 on CPU, by row count: torch's `F.linear` on the weights as loaded for steps of one or
    two rows (single-stream decode: the same kernel, so the same result, as the model's own forward),
    and from `min_rows` up a second copy of each matrix reordered for oneDNN. Costs the second copy."""

    def __init__(self, batch_hint: int, min_rows: int = 3) -> None:
        self.onednn = OneDnnGemm(batch_hint)
        self.min_rows = min_rows

    def prepare(self, w: torch.Tensor) -> tuple[torch.Tensor, object]:
        return w, self.onednn.prepare(w)

    def linear(self, x: torch.Tensor, w: tuple, b: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] >= self.min_rows:
            return self.onednn.linear(x, w[1], b)
        return super().linear(x, w[0], b)

    def linear_add(self, x: torch.Tensor, w: tuple, residual: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= self.min_rows:
            return self.onednn.linear_add(x, w[1], residual)
        return super().linear_add(x, w[0], residual)


def _onednn_ok(device: torch.device) -> bool:
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def choose_gemm(device: torch.device, dtype: torch.dtype, batch_hint: int = 32) -> tuple[Gemm, Gemm]:
    """(GEMM for the decoder layers, GEMM for the LM head). On CPU, bf16/fp16 use oneDNN throughout;
    float32 switches by row count (`SplitGemm`: F.linear below 3 rows, oneDNN from there). Measured as
    whole decode steps (docs/bench-log.md, "GEMM"): a float32 step at 32 running takes
    47 ms with oneDNN's reordered weights against 89-98 ms with MKL's packed sgemm and 105 ms with
    F.linear, although timing each weight shape alone (bench/gemm_shapes.py) had favoured MKL."""
    if not _onednn_ok(device):
        return Gemm(), Gemm()
    if dtype == torch.float32:
        split = SplitGemm(batch_hint)
        return split, split
    supported = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}[dtype]
    check = getattr(torch.ops.mkldnn, supported, None)
    if check is not None and check():  # the CPU has the instructions (AVX512-BF16 / AMX / AVX512-FP16)
        onednn = OneDnnGemm(batch_hint)
        return onednn, onednn
    return Gemm(), Gemm()
