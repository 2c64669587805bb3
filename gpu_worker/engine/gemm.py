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


class MklPackedGemm(Gemm):
    """float32 CPU matmuls on a weight packed once for MKL's sgemm (`cblas_sgemm_pack`). torch's op
    takes the row count the weight was packed for and falls back to an unpacked matmul for any
    other. MKL does not promise that a packed copy serves other row counts, but its layout has been
    observed to be the same from two rows up, so the call passes the actual rows and one packed copy
    serves every step; `serves_any_rows` checks that per weight shape, up to the largest step,
    before the packed copy is used."""

    _checked: dict[tuple[int, ...], bool] = {}  # (out, in, batch_hint, max_rows): checked once per process

    def __init__(self, batch_hint: int, max_rows: int = 2048) -> None:
        self.batch_hint = batch_hint
        self.max_rows = max_rows

    def prepare(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = w.detach().contiguous()  # the op reads this too, to learn the shape
        return w, torch.ops.mkl._mkl_reorder_linear_weight(w, self.batch_hint)

    def linear(self, x: torch.Tensor, w: tuple, b: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.mkl._mkl_linear(x, w[1], w[0], b, x.numel() // x.shape[-1])

    def linear_add(self, x: torch.Tensor, w: tuple, residual: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkl._mkl_linear(x, w[1], w[0], None, x.numel() // x.shape[-1]).add_(residual)

    def serves_any_rows(self, w: torch.Tensor) -> bool:
        """Whether a packed copy of a weight of this shape gives the matmul's result at row counts
        other than the one it was packed for, from 2 rows to `max_rows`."""
        shape = tuple(w.shape)
        key = (*shape, self.batch_hint, self.max_rows)
        if key not in self._checked:
            gen = torch.Generator().manual_seed(0)
            probe = torch.randn(shape, generator=gen) / shape[1] ** 0.5
            rows_to_try = sorted({2, 3, 17, self.batch_hint + 7, 64, 300, self.max_rows})
            try:
                packed = self.prepare(probe)
                ok = True
                for rows in rows_to_try:
                    x = torch.randn(rows, shape[1], generator=gen)
                    ok = ok and torch.allclose(self.linear(x, packed), F.linear(x, probe), rtol=1e-4, atol=1e-5)
            except RuntimeError as exc:
                log.warning("MKL packing unusable for a %s weight (%s); using oneDNN", shape, exc)
                ok = False
            self._checked[key] = ok
        return self._checked[key]


class SplitGemm(Gemm):
    """float32 on CPU, by row count: torch's `F.linear` on the weights as loaded for steps of one or
    two rows (single-stream decode: the same kernel, so the same result, as the model's own forward),
    and from `min_rows` up a second copy of each matrix, packed for MKL or, where packing does not
    serve every row count (or is not wanted), reordered for oneDNN. Costs the second copy."""

    def __init__(self, batch_hint: int, min_rows: int = 3, mkl_packing: bool = True) -> None:
        self.packed = MklPackedGemm(batch_hint) if mkl_packing else None
        self.onednn = OneDnnGemm(batch_hint)
        self.min_rows = min_rows

    def prepare(self, w: torch.Tensor) -> tuple[torch.Tensor, Gemm, object]:
        wide = self.packed if self.packed is not None and self.packed.serves_any_rows(w) else self.onednn
        return w, wide, wide.prepare(w)

    def linear(self, x: torch.Tensor, w: tuple, b: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] >= self.min_rows:
            return w[1].linear(x, w[2], b)
        return super().linear(x, w[0], b)

    def linear_add(self, x: torch.Tensor, w: tuple, residual: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= self.min_rows:
            return w[1].linear_add(x, w[2], residual)
        return super().linear_add(x, w[0], residual)


def _onednn_ok(device: torch.device) -> bool:
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def _mkl_packing_ok() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


def choose_gemm(device: torch.device, dtype: torch.dtype, batch_hint: int = 32) -> tuple[Gemm, Gemm]:
    """(GEMM for the decoder layers, GEMM for the LM head). On CPU, bf16/fp16 use oneDNN throughout.
    float32 switches by row count (`SplitGemm`). Timed with weights read from memory as a step reads
    them (bench/gemm_shapes.py --copies 30, us, F.linear / oneDNN / MKL packed): a layer's four
    matrices 592 / 802 / 560 at 1 row, 1019 / 841 / 695 at 4, 1837 / 1619 / 1335 at 32; the LM head
    9616 / 4787 / 5446 at 4, 13897 / 10553 / 10193 at 32. So the layers take MKL's packed copy from
    3 rows and the LM head oneDNN's."""
    if not _onednn_ok(device):
        return Gemm(), Gemm()
    if dtype == torch.float32:
        return SplitGemm(batch_hint, mkl_packing=_mkl_packing_ok()), SplitGemm(batch_hint, mkl_packing=False)
    supported = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}[dtype]
    check = getattr(torch.ops.mkldnn, supported, None)
    if check is not None and check():  # the CPU has the instructions (AVX512-BF16 / AMX / AVX512-FP16)
        onednn = OneDnnGemm(batch_hint)
        return onednn, onednn
    return Gemm(), Gemm()
