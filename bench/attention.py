"""Attention alone, in half precision on CPU: the model's paths side by side, on a one-layer random model with the
default model's attention shape (9 query heads, 3 KV heads, head dim 64), per layer, median of --iters.

Decode, per rows and tokens read: `sdpa`, torch's SDPA computed in float32 (q, K and V upcast); `matmul`, two
batched matmuls per (row, KV head) with a float32 softmax; both `Llama.attend_decode` on the same gathered K/V.
Where `matmul` starts to win is `MATMUL_ATTENTION_MIN_READ` in gpu_worker/engine/models/llama.py (rows x tokens).

Prefill (`--prefill CHUNKSxROWS`: a step of that many first chunks of that many tokens, as a burst of new prompts):
`paged`, the kernel reading the cache in place (`Llama.paged_prefill`, where the CPU has AVX512 or AVX2),
alternating with the path it replaces: in bfloat16 `batched`, the chunks padded into one batch of matmuls over K/V
gathered from the cache (`Llama._prefill_batch`); in float32 `sdpa`, chunk by chunk (`Llama._prefill`), and, on a
CPU with AVX512, `paged-avx2`: the kernel as an AVX2-only CPU builds it (8 lanes).

    .venv/bin/python -m bench engine attention                      # rows 1-32 at 100 and 400 tokens
    .venv/bin/python -m bench engine attention --prefill 32x452 --iters 20            # and --dtype float32
    .venv/bin/python -m bench engine attention --quick
"""

from __future__ import annotations

import statistics
import time

from bench.common import parser


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, model=False)
    p.add_argument("--rows", default="1,2,4,8,16,32")
    p.add_argument("--tokens", default="100,400")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefill", default="", help="prefill mode: CHUNKSxROWS (e.g. 32x452)")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.tokens, args.iters = "1,8", "64", 5
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from gpu_worker.engine import EngineConfig
    from gpu_worker.engine.model_runner import ModelRunner  # on CPU it sets the engine's malloc tunables

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=576, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048)
    runner = ModelRunner(EngineConfig(model="unused", device="cpu", dtype=args.dtype, kv_cache_mb=64),
                         LlamaForCausalLM(cfg).eval())
    model = runner.model
    dt, H, KV, D = model.dtype, model.num_heads, model.kv_heads, model.head_dim
    if args.prefill or args.quick:
        prefill(runner, args.prefill or "3x40", args.iters)
        if args.prefill:
            return 0

    def per_layer(*attend_args) -> float:
        for _ in range(3):
            model.attend_decode(*attend_args)
        times = []
        for _ in range(args.iters):
            t = time.perf_counter()
            model.attend_decode(*attend_args)
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e6

    print(f"decode attention per layer, us, {args.dtype}, {args.threads} torch threads, median of {args.iters}\n")
    print("| tokens a row | rows | sdpa (float32) | matmul | matmul / sdpa |")
    print("|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        for T in (int(t) for t in args.tokens.split(",")):
            for rows in (int(r) for r in args.rows.split(",")):
                q = torch.randn(rows, H, D, dtype=dt)
                k, v = (torch.randn(rows, KV, T, D, dtype=dt) for _ in range(2))
                mask = torch.ones(rows, 1, 1, T, dtype=torch.bool)
                bias = torch.zeros(rows * KV, 1, T, dtype=dt)
                sdpa = per_layer(q, k, v, mask, None)
                mm = per_layer(q, k, v, mask, bias)
                print(f"| {T} | {rows} | {sdpa:.1f} | {mm:.1f} | {mm / sdpa:.2f} |")
    return 0


def prefill(runner, shape: str, iters: int) -> None:  # type: ignore[no-untyped-def]
    """The `--prefill` mode: one step of `shape` first chunks, each path's attention over layer 0, per layer."""
    import torch

    from gpu_worker.engine import StepBatch, cpu_kernels
    from gpu_worker.engine.block_manager import BlockManager
    from gpu_worker.engine.sequence import Sequence
    from shared.schemas import Request

    chunks, rows = (int(x) for x in shape.split("x"))
    model, cache = runner.model, runner.cache
    blocks = BlockManager(cache.num_blocks, cache.block_size, False)
    seqs = [Sequence(Request(f"p{i}", [5 + (i * 7 + j) % 200 for j in range(rows)])) for i in range(chunks)]
    assert all(blocks.allocate(s) for s in seqs), "the cache holds too few blocks for this shape"
    batch = StepBatch(decode=[], chunks=[(s, rows) for s in seqs])
    kc, vc = cache.k[0], cache.v[0]
    kc.normal_(), vc.normal_()
    H, D = model.num_heads, model.head_dim
    qkv = torch.randn(chunks * rows, H + 2 * model.kv_heads, D, dtype=model.dtype)
    q, k, v = qkv[:, :H], qkv[:, H : H + model.kv_heads], qkv[:, H + model.kv_heads :]
    kernel = model.paged_prefill
    paths = {}
    if kernel is not None:
        spec = runner.prepare(batch).attn.prefill_tables
        out = torch.empty(chunks * rows, H, D, dtype=model.dtype)
        paths["paged"] = lambda: kernel(q, kc, vc, spec, cache.block_size, out)
        avx2 = cpu_kernels.build_paged_prefill_avx2() if model.dtype == torch.float32 else None
        if avx2 is not None:
            spec2 = spec._replace(work=torch.empty(avx2.workspace(spec.starts, spec.lengths, model.kv_heads, D,
                                                                  model.dtype), dtype=torch.int32))
            paths["paged-avx2"] = lambda: avx2(q, kc, vc, spec2, cache.block_size, out)
    model.paged_prefill = None
    attn = runner.prepare(batch).attn
    model.paged_prefill = kernel
    kf, vf = kc.view(-1, D), vc.view(-1, D)
    pre = attn.prefill
    if pre is not None:  # bfloat16
        pblocks = model._prefill_blocks(pre)
        paths["batched"] = lambda: model._prefill_batch(q, kf, vf, pre, pblocks)
    else:  # float32: chunk by chunk through SDPA
        paths["sdpa"] = lambda: [model._prefill(q, k, v, kf, vf, c) for c in attn.chunks]
    times: dict[str, list[float]] = {name: [] for name in paths}
    with torch.inference_mode():
        for fn in paths.values():
            fn()
        for _ in range(iters):
            for name, fn in paths.items():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print(f"prefill attention per layer, ms, {chunks} chunks x {rows} tokens, {model.dtype}, "
          f"{torch.get_num_threads()} torch threads, median of {iters}, alternating: "
          + ", ".join(f"{name} {v:.2f}" for name, v in ms.items())
          + "".join(f"; {name} / {kern} {ms[name] / ms[kern]:.2f}x" for kern in ms if kern.startswith("paged")
                    for name in ms if not name.startswith("paged")))
