"""Decode attention alone, in half precision on CPU: the model's two paths side by side, per rows and tokens read.

`sdpa`: torch's SDPA computed in float32 (q, K and V upcast); `matmul`: two batched matmuls per (row, KV
head) with a float32 softmax. Both are `Llama.attend_decode` on the same gathered K/V, on a one-layer
random model with the default model's attention shape (9 query heads, 3 KV heads, head dim 64). Microseconds
per layer, median of --iters. Where `matmul` starts to win is `MATMUL_ATTENTION_MIN_READ` in
gpu_worker/engine/models/llama.py (rows x tokens).

    .venv/bin/python -m bench.attention                      # rows 1-32 at 100 and 400 tokens
    .venv/bin/python -m bench.attention --quick
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,2,4,8,16,32")
    p.add_argument("--tokens", default="100,400")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true")
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
    runner = ModelRunner(EngineConfig(model="unused", device="cpu", dtype=args.dtype, kv_cache_mb=16),
                         LlamaForCausalLM(cfg).eval())
    model = runner.model
    dt, H, KV, D = model.dtype, model.num_heads, model.kv_heads, model.head_dim

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


if __name__ == "__main__":
    from shared.lifecycle import exit_quickly

    exit_quickly(main())
