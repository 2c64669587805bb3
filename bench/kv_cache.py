"""KV-cache memory on a mixed-length workload: what the paged cache holds against what its sequences use,
beside what the dense slot cache it replaced would have held for the same running set.

Workload: one long request (--long tokens) among --short short ones (--short-len tokens each), all
submitted at once, each generating --max-new tokens (greedy, EOS ignored). At every step it records
the tokens the running sequences hold (prompt + generated so far) and the token slots allocated:
paged = blocks held x block size; dense = the old layout, rows rounded up to 8 times the longest row
rounded up to 128 (capped at the model's context). Waste = allocated but unused slots / allocated,
over all steps. It also reports how many sequences ran at once.

    .venv/bin/python -m bench engine kv-cache                 # the default model, float32
    .venv/bin/python -m bench engine kv-cache --quick         # a tiny random model, seconds
"""

from __future__ import annotations

import json

from bench.common import chosen_model, parser


def round_up(x: int, step: int) -> int:
    return max(step, -(-x // step) * step)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--long", type=int, default=3000)
    p.add_argument("--short", type=int, default=30)
    p.add_argument("--short-len", type=int, default=50)
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args(argv)
    if args.quick:
        args.long, args.short, args.max_new = 600, 8, 4
    from gpu_worker.engine import EngineConfig, LLMEngine
    from shared.schemas import Request

    engine = LLMEngine(EngineConfig(model=chosen_model(args), dtype="float32", max_num_seqs=64,
                                    max_model_len=4096, block_size=args.block_size, max_num_batched_tokens=4096))
    reqs = [Request("long", [100 + i % 5000 for i in range(args.long)], max_tokens=args.max_new, temperature=0,
                    ignore_eos=True)]
    reqs += [Request(f"s{i}", [200 + i + j % 7 for j in range(args.short_len)], max_tokens=args.max_new,
                     temperature=0, ignore_eos=True) for i in range(args.short)]
    for r in reqs:
        engine.add_request(r)
    used = paged = dense = 0
    most = 0
    cap = engine.max_model_len
    while engine.has_unfinished():
        engine.step()
        running = engine.scheduler.running
        if not running:
            continue
        most = max(most, len(running))
        used += sum(s.num_tokens for s in running)
        paged += sum(len(s.block_table) for s in running) * args.block_size
        dense += round_up(len(running), 8) * min(cap, round_up(max(s.num_tokens for s in running), 128))
    res = {"requests": len(reqs), "most_running": most, "block_size": args.block_size,
           "paged_waste": round(1 - used / paged, 4), "dense_waste": round(1 - used / dense, 4),
           "dense_over_paged_slots": round(dense / paged, 2)}
    print(json.dumps(res))
    print("| cache | allocated token slots per used token | waste (allocated, unused) |")
    print("|---|---|---|")
    print(f"| paged, blocks of {args.block_size} | {paged / used:.3f} | {res['paged_waste']:.1%} |")
    print(f"| dense slots (before) | {dense / used:.2f} | {res['dense_waste']:.1%} |")
    return 0
