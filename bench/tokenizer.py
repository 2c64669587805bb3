"""The tokenizer stage alone: a batch of chat prompts through the chat template and batch encoding, as the
tokenizer worker does them (workers/tokenizer/prompt.py), on the default model's tokenizer. What a flood of
long prompts costs the jobs behind it in that first-in, first-out stage (README, "Fair share").

    .venv/bin/python -m bench serve tokenizer                 # 64 prompts of ~3,250 tokens, 3 repeats
    .venv/bin/python -m bench serve tokenizer --quick         # seconds
"""

from __future__ import annotations

import statistics
import time

from bench.common import default_model, parser

SENTENCE = "The quick brown fox jumps over the lazy dog near the riverbank. "  # 14 tokens


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--batch", type=int, default=64, help="prompts per batch (TOKENIZER_BATCH)")
    p.add_argument("--sentences", type=int, default=230, help="sentences per prompt (~14 tokens each)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.sentences, args.repeats = 4, 10, 1
    from shared.schemas import GenerationRequest
    from workers.tokenizer.prompt import PromptBuilder

    builder = PromptBuilder(args.model or default_model())
    reqs = [GenerationRequest(messages=[{"role": "user", "content": f"{i} {SENTENCE * args.sentences}"}])
            for i in range(args.batch)]
    times, tokens = [], 0
    for _ in range(args.repeats):
        t = time.perf_counter()
        ids = builder.encode_batch([builder.render(r) for r in reqs], [False] * len(reqs))
        times.append(time.perf_counter() - t)
        tokens = sum(len(x) for x in ids)
    dt = statistics.median(times)
    print("| prompts | tokens each | ms per batch | M prompt tokens/s |\n|---:|---:|---:|---:|")
    print(f"| {args.batch} | {tokens // args.batch:,} | {dt * 1000:.0f} | {tokens / dt / 1e6:.2f} |")
    return 0
