#!/usr/bin/env bash
# GPU check: our engine vs transformers' continuous batching (generate_batch) on one NVIDIA GPU.
#
#   bench/gpu_check.sh            # on a machine with one NVIDIA GPU; needs no network
#   bench/gpu_check.sh --smoke    # tiny model on CPU, to test the script itself: every phase, one level of
#                                 # 2 requests x 4 new tokens, no warm-up waves, a small hf-cb cache
#
# Builds a randomly initialised Llama of about 1.1B parameters from a LlamaConfig (nothing comes
# from a hub), saves it to a temporary directory, then runs each contender in its own process, with
# a timeout per phase, at 1, 32, 128 and 256 concurrent requests (random prompts of 64 tokens,
# 128 new tokens, greedy, EOS ignored; each level submits all its requests at once) and prints a
# Markdown table. A phase that fails or times out is reported and the others still run.
#
# Environment: PYTHON (default .venv/bin/python, else python3), PHASE_TIMEOUT seconds (default 900),
# KV_CACHE_MB for our engine (default 8192), LEVELS (default "1 32 128 256"; "2" with --smoke), KEEP=1 keeps
# the model.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SMOKE=0
for arg in "$@"; do
  case "$arg" in
    --smoke) SMOKE=1 ;;
    -h|--help) sed -n '2,18p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
PHASE_TIMEOUT="${PHASE_TIMEOUT:-900}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
export SMOKE KV_CACHE_MB="${KV_CACHE_MB:-8192}"
if [[ "$SMOKE" == 1 ]]; then export LEVELS="${LEVELS:-2}"; else export LEVELS="${LEVELS:-1 32 128 256}"; fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/conveyor-gpu-check.XXXXXX")"
cleanup() { if [[ "${KEEP:-0}" == 1 ]]; then echo "kept $WORK"; else rm -rf "$WORK"; fi; }
trap cleanup EXIT

cat > "$WORK/check.py" <<'PY'
"""Phases of bench/gpu_check.sh: build | ours | hf-cb | table. Results go to <work>/<phase>.json."""
import json
import logging
import os
import sys
import time
import warnings

from bench.common import percentile

SMOKE = os.environ.get("SMOKE") == "1"
LEVELS = [int(x) for x in os.environ["LEVELS"].split()]
DEVICE = "cpu" if SMOKE else "cuda"
PROMPT_LEN, MAX_NEW = (16, 4) if SMOKE else (64, 128)


def prompts(n, vocab, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(PROMPT_LEN - 8, PROMPT_LEN + 9, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lens]


def summary(first, times, wall, n_tokens):
    """first: per request, seconds from submission to first token; times: per request token times."""
    itl = [b - a for ts in times for a, b in zip(ts, ts[1:])]
    return {"tok_s": n_tokens / wall, "ttft_p50_ms": percentile(first, 50) * 1e3,
            "ttft_p99_ms": percentile(first, 99) * 1e3, "itl_p50_ms": percentile(itl, 50) * 1e3,
            "itl_p99_ms": percentile(itl, 99) * 1e3, "wall_s": wall}


def sync():
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def environment():
    """The versions and the GPU (in the build phase: one process fewer than a phase of its own)."""
    import torch
    import transformers

    print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
          f"transformers {transformers.__version__}")
    print("GPU:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none", flush=True)
    if not SMOKE and not torch.cuda.is_available():
        sys.exit("no CUDA device visible to torch; use --smoke to test the script on CPU")


def build(model_dir):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    environment()
    if SMOKE:
        cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=128, vocab_size=1000, max_position_embeddings=512)
    else:
        cfg = LlamaConfig(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                          intermediate_size=8192, vocab_size=32000, max_position_embeddings=2048,
                          tie_word_embeddings=False)
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = 1, 2, 0
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(model_dir)
    print(f"built a random Llama of {n / 1e9:.2f}B parameters in {model_dir}")
    return {"params": n}


def run_ours(model_dir):
    from gpu_worker.engine import EngineConfig, LLMEngine
    from shared.schemas import Request

    engine = LLMEngine(EngineConfig(model=model_dir, device=DEVICE, dtype="bfloat16", max_num_seqs=256,
                                    max_num_batched_tokens=8192, kv_cache_mb=int(os.environ["KV_CACHE_MB"])))
    vocab = engine.runner.vocab_size

    def wave(reqs, max_new):
        for i, ids in enumerate(reqs):
            engine.add_request(Request(str(i), ids, max_tokens=max_new, temperature=0.0, ignore_eos=True))
        t0 = time.perf_counter()
        times = [[] for _ in reqs]
        while engine.has_unfinished():
            outs = engine.step()
            t = time.perf_counter() - t0
            for o in outs:
                if o.error:
                    raise RuntimeError(f"request {o.id}: {o.error}")
                times[int(o.id)].extend([t] * len(o.token_ids))
        wall = time.perf_counter() - t0
        return times, wall

    if not SMOKE:
        wave(prompts(max(LEVELS), vocab, 99), 4)  # warm-up: allocator, kernels, the cache at full size
    out = {}
    for c in LEVELS:
        times, wall = wave(prompts(c, vocab, c), MAX_NEW)
        bad = [len(ts) for ts in times if len(ts) != MAX_NEW]
        if bad:
            raise RuntimeError(f"{c} concurrent: token counts {bad[:4]} != {MAX_NEW}")
        out[str(c)] = summary([ts[0] for ts in times], times, wall, c * MAX_NEW)
        print(f"ours  c={c:4d}: {out[str(c)]['tok_s']:9.1f} tok/s", flush=True)
    return out


def cb_wave(manager, inputs, max_new):
    """Submit all inputs at once; wait for every one to finish."""
    ids = manager.add_requests(inputs, max_new_tokens=max_new, record_timestamps=True)
    got = {}
    while len(got) < len(ids):
        r = manager.get_result(timeout=120)
        if r is None:
            raise RuntimeError(f"{len(inputs)} concurrent: no result within 120 s ({len(got)}/{len(ids)} done)")
        if r.is_finished():
            got[r.request_id] = r
    return list(got.values())


def run_hf_cb(model_dir):
    """The manager `generate_batch` builds, sized from the same workload hints; its construction, warm-up
    (graph capture where used) and thread start stay out of the timing, as our engine's do."""
    import torch
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(DEVICE).eval()
    vocab = model.config.vocab_size
    gen = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=-1)
    # on CPU the cache would otherwise be sized from the host's free memory (gigabytes for a tiny model)
    cb_config = ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=256) if SMOKE else None
    out = {}
    for c in LEVELS:
        inputs = prompts(c, vocab, c)
        hints = WorkloadHints(max_prompt_length=max(map(len, inputs)), max_generated_length=MAX_NEW, num_requests=c)
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb_config,
                                                 workload_hints=hints)
        manager.warmup()
        manager.start()

        try:
            if not SMOKE:
                cb_wave(manager, inputs, 4)  # warm-up
            sync()
            t0 = time.perf_counter()
            res = cb_wave(manager, inputs, MAX_NEW)
            wall = time.perf_counter() - t0
        finally:
            manager.stop(block=True, timeout=60)
            manager.destroy()
        errors = [r.error for r in res if r.error]
        if errors:
            raise RuntimeError(f"{c} concurrent: {len(errors)} failed requests, e.g. {errors[0]}")
        tokens = sum(len(r.generated_tokens) for r in res)
        first = [r.timestamps[0] - r.created_time for r in res]
        out[str(c)] = summary(first, [r.timestamps for r in res], wall, tokens)
        out[str(c)]["tokens_ok"] = tokens == c * MAX_NEW
        print(f"hf-cb c={c:4d}: {out[str(c)]['tok_s']:9.1f} tok/s ({tokens} tokens)", flush=True)
    return out


def table(work):
    def load(name):
        path = os.path.join(work, f"{name}.json")
        return json.load(open(path)) if os.path.exists(path) else {}

    ours, cb = load("ours"), load("hf-cb")
    print("\n| contender | concurrent | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) "
          "| ours / hf-cb |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, res in (("ours (bf16)", ours), ("transformers continuous batching (bf16)", cb)):
        for c in LEVELS:
            r = res.get(str(c))
            if r is None:
                print(f"| {name} | {c} | failed or not run | | | | | |")
                continue
            other = cb.get(str(c)) if res is ours else None
            ratio = f"{r['tok_s'] / other['tok_s']:.2f}×" if other else ""
            flag = " (token count off)" if r.get("tokens_ok") is False else ""
            print(f"| {name} | {c} | {r['tok_s']:,.0f}{flag} | {r['ttft_p50_ms']:,.0f} | {r['ttft_p99_ms']:,.0f} "
                  f"| {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | {ratio} |")
    print(f"\n{PROMPT_LEN}±8-token random prompts, {MAX_NEW} new tokens each, all requests of a level submitted at "
          f"once; TTFT from submission; tok/s = generated tokens / wall time of the level.")


def main():
    phase, work = sys.argv[1], sys.argv[2]
    if phase == "table":  # reads the JSON files only: no torch, no transformers
        return table(work)
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    model_dir = os.path.join(work, "model")
    result = {"build": build, "ours": run_ours, "hf-cb": run_hf_cb}[phase](model_dir)
    with open(os.path.join(work, f"{phase}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
    import gc

    gc.freeze()  # the interpreter's teardown then skips collecting torch's objects (~0.8 s of CPU a phase)
PY

echo "== environment"
date -u +"%Y-%m-%d %H:%M UTC"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
failed=()
phase() {
  local name="$1" limit="$2"
  echo "== $name (timeout ${limit}s)"
  local rc=0
  timeout --kill-after=30 "$limit" "$PYTHON" "$WORK/check.py" "$name" "$WORK" || rc=$?
  if [[ $rc -ne 0 ]]; then
    if [[ $rc -eq 124 || $rc -eq 137 ]]; then echo "phase $name timed out after ${limit}s" >&2
    else echo "phase $name failed (exit $rc)" >&2; fi
    failed+=("$name")
    return 1
  fi
}

phase build "$PHASE_TIMEOUT" || { echo "cannot build the model; stopping" >&2; exit 1; }
phase ours "$PHASE_TIMEOUT" || true
phase hf-cb "$PHASE_TIMEOUT" || true
phase table 60
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "failed phases: ${failed[*]}" >&2
  exit 1
fi
