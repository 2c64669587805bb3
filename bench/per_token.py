"""What the per-token features cost the engine: output tok/s at 32 streams with a JSON schema on every row,
and with logprobs + top_logprobs 5 on every row, each against the same batch with neither, in one process,
interleaved, median over rounds. And the time to compile a typical schema, first and cached.

    .venv/bin/python -m bench engine per-token                  # default model, 32 x 64 tokens, 3 rounds
    .venv/bin/python -m bench engine per-token --quick          # tiny model, seconds
"""

from __future__ import annotations

import json
import os
import statistics
import time

from bench.common import chosen_model, parser

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"}, "year": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "rating": {"type": "number"}, "summary": {"type": "string"}},
    "required": ["title", "year", "tags", "summary"]}


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    from bench.common import PROMPTS

    model = chosen_model(args)
    if args.quick:
        args.streams, args.tokens, args.rounds = 4, 8, 1
    import torch
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from gpu_worker.engine import EngineConfig, LLMEngine
    from shared.model_config import vocab_size
    from shared.schemas import GenerationRequest, Request
    from workers.tokenizer.prompt import PromptBuilder

    engine = LLMEngine(EngineConfig(model=model, dtype=args.dtype, max_num_seqs=args.streams,
                                    threads=args.threads, prefix_caching=False))
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(model), vocab_size=vocab_size(model))
    t_info = time.perf_counter() - t0
    compiler = xgr.GrammarCompiler(info)
    source = json.dumps(SCHEMA)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(source)
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiler.compile_json_schema(source)
    t_cached = time.perf_counter() - t0
    serialized = compiled.serialize_json()
    t0 = time.perf_counter()
    xgr.CompiledGrammar.deserialize_json(serialized, info)
    t_load = time.perf_counter() - t0

    pb = PromptBuilder(model)
    texts = [pb.render(GenerationRequest(messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]
                                                    + " Answer as JSON."}])) for i in range(args.streams)]
    prompts = pb.encode_batch(texts, [False] * len(texts))
    variants = {
        "plain": {},
        "logprobs, top 5": {"logprobs": 5},
        "json_schema": {"grammar_kind": "json_schema", "grammar": source},
    }

    def run(name: str, round_: int) -> float:
        kw = variants[name]
        for i, ids in enumerate(prompts):
            req = Request(f"{name}-{round_}-{i}", ids, max_tokens=args.tokens, temperature=1.0, seed=i, **kw)
            if "grammar_kind" in kw:
                req.compiled_grammar = compiled
            engine.add_request(req)
        n, t = 0, time.perf_counter()
        while engine.has_unfinished():
            n += sum(len(o.token_ids) for o in engine.step())
        return n / (time.perf_counter() - t)

    run("plain", -1)  # warm-up
    results: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(args.rounds):
        for name in variants:
            results[name].append(run(name, r))
    base = statistics.median(results["plain"])
    print(f"per-token features: {os.path.basename(model.rstrip('/'))}, dtype {engine.runner.dtype}, "
          f"{args.streams} streams x {args.tokens} tokens, temperature 1, prefix cache off, "
          f"{torch.get_num_threads()} threads, median of {args.rounds} interleaved rounds\n")
    print("| rows carry | output tok/s | vs plain | rounds |")
    print("|---|---:|---:|---|")
    for name, vals in results.items():
        med = statistics.median(vals)
        print(f"| {name} | {med:.0f} | {med / base:.2f}x | {', '.join(f'{v:.0f}' for v in vals)} |")
    print(f"\nschema compile: tokenizer info {t_info * 1000:.0f} ms (once per process), first {t_first * 1000:.1f} ms, "
          f"cached {t_cached * 1000:.2f} ms; serialized {len(serialized) / 1024:.0f} KiB, "
          f"loaded by a worker in {t_load * 1000:.1f} ms")
    return 0
