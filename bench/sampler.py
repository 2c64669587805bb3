"""The sampler alone: milliseconds per engine step to sample every row of a batch, per sampling setting.

Random logits of the default model's vocabulary (49,152; scaled so the distribution is neither flat
nor one-hot), the rows all sampled (no greedy rows), two torch threads, median of --iters calls after a
warm-up. What serving pays per step on top of the model when clients leave temperature at its
default of 1 (guidellm, most OpenAI clients), or set top_p / top_k.

    .venv/bin/python -m bench engine sampler                  # rows 1, 8, 32, 64
    .venv/bin/python -m bench engine sampler --scale 0.05     # nearly flat, as a model of random weights gives
    .venv/bin/python -m bench engine sampler --quick          # seconds

A grammar's row also pays its mask: filled by xgrammar, added to the logits (`gpu_worker/engine/grammar.py`).
"""

from __future__ import annotations

import statistics
import time

from bench.common import parser

SETTINGS = {  # name -> Request keyword arguments
    "temperature 1": {"temperature": 1.0},
    "temperature 0.7, top_p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "temperature 0.8, top_k 50": {"temperature": 0.8, "top_k": 50},
    "temperature 0.7, a JSON schema": {"temperature": 0.7, "grammar_kind": "json_schema"},
}
SCHEMA = '{"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}'


def json_grammar(vocab: int):  # type: ignore[no-untyped-def]
    """A compiled JSON-schema grammar over a vocabulary of `vocab` tokens: the 95 printable ASCII characters,
    then made-up words (each row's mask is filled and applied as for a real tokenizer's)."""
    import xgrammar as xgr

    chars = [chr(c) for c in range(32, 127)]
    words = chars + [f"w{i}" for i in range(vocab - len(chars))]
    return xgr.GrammarCompiler(xgr.TokenizerInfo(words)).compile_json_schema(SCHEMA)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, model=False)
    p.add_argument("--rows", default="1,8,32,64")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--scale", type=float, default=3.0, help="the logits' standard deviation (3: neither flat nor "
                   "one-hot; 0.05: nearly flat, so top_p 0.9 keeps most of the vocabulary)")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.vocab, args.iters = "1,8", 4096, 3
    import torch

    from gpu_worker.engine.sampler import Sampler
    from gpu_worker.engine.sequence import Sequence
    from shared.schemas import Request

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"sampler: ms per step, every row sampled; vocabulary {args.vocab}, logits' scale {args.scale}, "
          f"{args.threads} torch threads, median of {args.iters}\n")
    print("| setting | " + " | ".join(f"{r} rows" for r in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    for name, kw in SETTINGS.items():
        cells = []
        for n in rows:
            logits = torch.randn(n, args.vocab) * args.scale
            seqs = [Sequence(Request(f"r{i}", [1], seed=i, **kw)) for i in range(n)]
            if "grammar_kind" in kw:
                from gpu_worker.engine.grammar import GrammarState

                compiled = json_grammar(args.vocab)
                for s in seqs:
                    s.grammar = GrammarState(compiled)
            sampler = Sampler()
            sampler(logits, seqs)
            times = []
            for _ in range(args.iters):
                t = time.perf_counter()
                sampler(logits, seqs)
                times.append(time.perf_counter() - t)
            cells.append(f"{statistics.median(times) * 1000:.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0
