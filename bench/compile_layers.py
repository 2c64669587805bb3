"""The decoder layers of a decode step under `torch.compile` against eager, measured alone, optionally beside a
busy neighbour.

A standalone decode step over the model's own modules with plain weights (inductor's freezing packs them),
K/V in a flat cache gathered per row and attention in float32, as the engine's model does: eager, then compiled
with dynamic shapes (the warm-up is the compile). `--hog` runs a process that keeps about half a core busy
(6 ms spin, 6 ms sleep) during the timed steps: how much each loses to a busy machine. Our runner's own step
time for comparison: `python -m bench engine step --batches 32 --dtypes D`.

    .venv/bin/python -m bench engine compile --dtype bfloat16
    .venv/bin/python -m bench engine compile --dtype bfloat16 --hog
    .venv/bin/python -m bench engine compile --quick     # seconds: a tiny model, its first layer, 4 rows x 20 tokens
"""

from __future__ import annotations

import time

from bench.common import busy_neighbour, chosen_model, parser


def layers_ms(model_dir: str, dtype_name: str, compiled: bool, rows: int, tokens: int,
              steps: int, n_layers: int = 0) -> tuple[float, float]:
    """(warm-up seconds, median ms of the layers of one decode step): the model's first `n_layers` (0: all)."""
    import statistics

    import torch
    import torch._inductor.config as inductor
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    inductor.freezing = True
    inductor.cpp.dynamic_threads = True
    dtype = getattr(torch, dtype_name)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    cfg = model.config
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    layers = list(model.model.layers)[:n_layers or None]

    def step(h, cos, sin, kcs, vcs, slots, idx, mask):
        nd, t = h.shape[0], mask.shape[-1]
        for i, L in enumerate(layers):
            a, m = L.self_attn, L.mlp
            x = L.input_layernorm(h)
            q, k = a.q_proj(x).view(nd, H, D), a.k_proj(x).view(nd, KV, D)
            v = a.v_proj(x).view(nd, KV, D)
            q = q * cos + q.roll(D // 2, dims=-1) * sin
            k = k * cos + k.roll(D // 2, dims=-1) * sin
            kcs[i].index_copy_(0, slots, k)
            vcs[i].index_copy_(0, slots, v)
            kk = kcs[i].index_select(0, idx).view(nd, t, KV, D).transpose(1, 2).float()
            vv = vcs[i].index_select(0, idx).view(nd, t, KV, D).transpose(1, 2).float()
            o = F.scaled_dot_product_attention(q.float().unsqueeze(2), kk, vv, attn_mask=mask, enable_gqa=True)
            h = h + a.o_proj(o.to(h.dtype).view(nd, H * D))
            x = L.post_attention_layernorm(h)
            h = h + m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x))
        return h

    fn = torch.compile(step, dynamic=True) if compiled else step
    per_row = tokens + 64
    kcs = [torch.zeros(rows * per_row, KV, D, dtype=dtype) for _ in layers]
    vcs = [torch.zeros(rows * per_row, KV, D, dtype=dtype) for _ in layers]

    def run(nd: int, t: int) -> None:
        h = torch.randn(nd, cfg.hidden_size, dtype=dtype)
        cos, sin = torch.randn(nd, 1, D, dtype=dtype), torch.randn(nd, 1, D, dtype=dtype)
        slots = torch.arange(nd) * per_row + t - 1
        idx = (torch.arange(nd)[:, None] * per_row + torch.arange(t)[None]).reshape(-1)
        fn(h, cos, sin, kcs, vcs, slots, idx, torch.ones(nd, 1, 1, t, dtype=torch.bool))

    with torch.inference_mode():
        t0 = time.perf_counter()
        for nd, t in ((rows, tokens), (rows - 2, tokens + 1), (rows, tokens + 3)):
            run(max(nd, 1), t)
        warm = time.perf_counter() - t0
        times = []
        for j in range(steps):
            t1 = time.perf_counter()
            run(rows, tokens + j % 3)
            times.append(time.perf_counter() - t1)
    return warm, statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--tokens", type=int, default=100, help="tokens each row attends to")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--layers", type=int, default=0, help="only the model's first N decoder layers (default: all)")
    p.add_argument("--hog", action="store_true", help="time beside a process that keeps half a core busy")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.tokens, args.steps, args.layers = 4, 20, 3, 1
    model = chosen_model(args)
    with busy_neighbour(args.hog) as hog:
        for compiled in (False, True):
            warm, ms = layers_ms(model, args.dtype, compiled, args.rows, args.tokens, args.steps, args.layers)
            print(f"{'compiled' if compiled else 'eager'} {args.dtype}: layers of a decode step at {args.rows} rows "
                  f"x {args.tokens} tokens {ms:.2f} ms (median of {args.steps}; warm-up {warm:.1f} s)"
                  + (f"  [first {args.layers} layer(s) only]" if args.layers else "")
                  + ("  [beside a half-core hog]" if hog else ""), flush=True)
    return 0
