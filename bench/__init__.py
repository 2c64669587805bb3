"""Benchmarks, run as modules from the repository root (`.venv/bin/python -m bench.engine --help`); each
has a `--quick` mode that tests/bench/test_bench_quick.py runs. BENCHMARKS.md holds the current figures.

- engine:      in-process generation, named contenders interleaved (and decode-step timing)
- gemm_shapes: CPU GEMM backends per weight shape
- serve:       HTTP load against the full stack (and TTFT by hop, and an idle stack's CPU)
- plumbing:    jobs/s, concurrent streams and relay delay on the synthetic engine
- redis_ops:   what each stage's Redis traffic costs Redis
- soak:        memory of every process over many jobs
- chaos:       nothing lost or corrupted while processes die and Redis restarts
- gpu_check.sh: the engine on one NVIDIA GPU against transformers' continuous batching

Shared parts: harness/stack.py (start and stop a stack, find its processes), harness/sse.py (read event
streams), common.py (prompts, models, percentiles, the wait for a quiet machine), plot.py (charts).
"""
