"""Per-shape CPU GEMM timing: torch's `F.linear` (MKL in float32) against oneDNN on a weight
reordered once (`torch.ops.mkldnn._reorder_linear_weight` + `_linear_pointwise`), the engine's packed
GEMM (`CPU_GEMM=packed`, where the CPU has it: on its pool, as many threads as torch's) and, in float32,
MKL on a weight packed once (`torch.ops.mkl._mkl_reorder_linear_weight` + `_mkl_linear`), at several
row counts. This is the measurement behind `choose_gemm` in gpu_worker/engine/gemm.py.

    .venv/bin/python -m bench engine gemm                      # SmolLM2-135M's shapes, float32
    .venv/bin/python -m bench engine gemm --dtype bfloat16
    .venv/bin/python -m bench engine gemm --quick              # seconds: 8 rows only, one call per figure

Shapes (in -> out): fused q/k/v, o, fused gate/up, down, LM head. Each figure is the smaller of two
medians of --n calls after --warmup calls, in microseconds; "layer" sums the four layer matrices.

By default each call reuses one weight, which then sits in the CPU's caches. A model's step reads
every layer's weights once, from memory: `--copies 30` cycles through 30 copies of each weight
(like 30 layers) so each call reads its weight cold, which is what a decode step sees.
"""

from __future__ import annotations

import itertools
import statistics
import time

import torch
import torch.nn.functional as F

from bench.common import parser
from gpu_worker.engine import cpu_kernels as ck

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}


def timed(fn, n: int, warmup: int = 10) -> float:
    for _ in range(warmup):
        fn()
    runs = []
    for _ in range(2):
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        runs.append(statistics.median(ts))
    return min(runs) * 1e6


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__, model=False)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rows", default="1,4,8,16,32,64")
    p.add_argument("--n", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10, help="untimed calls before each figure")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--copies", type=int, default=1, help="distinct copies of each weight to cycle through")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.n, args.warmup = "8", 1, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    mkl = dtype == torch.float32 and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
    ours = ck.load_packed_gemm() if ck.supports_packed_gemm(torch.device("cpu"), dtype) else None
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, "
          f"{args.copies} copies per weight; microseconds (torch / onednn" + (" / packed" if ours else "")
          + (" / mkl-packed)" if mkl else ")"))
    print("| rows | " + " | ".join(SHAPES) + " | layer |")
    print("|---" * (len(SHAPES) + 2) + "|")
    weights = {k: [torch.randn(o, i, dtype=dtype) * 0.05 for _ in range(args.copies)] for k, (i, o) in SHAPES.items()}
    packed = {k: [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in ws] for k, ws in weights.items()}
    mkl_packed = ({k: [torch.ops.mkl._mkl_reorder_linear_weight(w, 32) for w in ws] for k, ws in weights.items()}
                  if mkl else {})
    ours_packed = {k: [ours.pack(w) for w in ws] for k, ws in weights.items()} if ours else {}
    turn = itertools.count()
    for m in (int(r) for r in args.rows.split(",")):
        cells, layer = [], [0.0] * 4
        for k, (i, _) in SHAPES.items():
            x = torch.randn(m, i, dtype=dtype)
            ws, pws = weights[k], packed[k]
            a = timed(lambda x=x, ws=ws: F.linear(x, ws[next(turn) % len(ws)]), args.n, args.warmup)
            b = timed(lambda x=x, pws=pws: torch.ops.mkldnn._linear_pointwise(x, pws[next(turn) % len(pws)], None,
                                                                                 "none", [], ""), args.n, args.warmup)
            times = [a, b]
            if ours is not None:  # on its pool, torch's ops on one thread meanwhile (as in the engine)
                ours.own_threads()
                ows = ours_packed[k]
                times.append(timed(lambda x=x, ows=ows: ours(x, ows[next(turn) % len(ows)]), args.n, args.warmup))
                ck.release_threads()
            if mkl:  # packed for 32 rows, called with the actual rows, as the engine does
                mws = mkl_packed[k]

                def packed_call(x=x, ws=ws, mws=mws) -> torch.Tensor:
                    j = next(turn) % len(ws)
                    return torch.ops.mkl._mkl_linear(x, mws[j], ws[j], None, x.shape[0])

                times.append(timed(packed_call, args.n, args.warmup))
            cells.append(" / ".join(f"{t:.0f}" for t in times))
            if k != "lm_head":
                for j, t in enumerate(times):
                    layer[j] += t
        print(f"| {m} | " + " | ".join(cells) + " | " + " / ".join(f"{t:.0f}" for t in layer[: len(times)])
              + " |", flush=True)
