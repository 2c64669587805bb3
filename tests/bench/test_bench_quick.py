"""Every benchmark's `--quick` run ends well: a benchmark that drifts from the code it measures fails here.
Speed is never asserted; only that each script runs through and reports what it measures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


def bench(module: str, *args: str, timeout: float = 600) -> str:
    proc = subprocess.run([sys.executable, "-m", f"bench.{module}", "--quick", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"bench.{module}: exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_engine_contenders(tiny_model_dir: str, tmp_path: Path) -> None:
    out = bench("engine", "--model", tiny_model_dir, "--json", str(tmp_path / "engine.json"))
    for name in ("naive", "static", "hf-cb", "ours-fp32", "ours-bf16"):
        assert f"| {name}" in out
    assert "ours-fp32 greedy tokens == batch-1 `generate` for 2/2 requests" in out
    rows = json.loads((tmp_path / "engine.json").read_text())["results"]
    assert {r["level"] for r in rows} == {"all", "poisson"}


def test_engine_step_time(tiny_model_dir: str) -> None:
    out = bench("engine", "--model", tiny_model_dir, "--step-time", "1,4", "--after-idle", "0.1", "--dtypes", "float32")
    assert "batch   4: decode step" in out and "prefill step: warm" in out


def test_gemm_shapes() -> None:
    out = bench("gemm_shapes")
    assert out.count("\n| 8 |") == 1 and "lm_head" in out


def test_redis_ops() -> None:
    out = bench("redis_ops")
    assert "chunk-step x32" in out and "per job:" in out


@pytest.mark.slow
def test_plumbing(tmp_path: Path) -> None:
    bench("plumbing", "--json", str(tmp_path / "plumbing.json"))
    result = json.loads((tmp_path / "plumbing.json").read_text())
    assert result["accept"] and all(r["accepted_per_s"] > 0 for r in result["accept"])
    assert all(r["complete"] == r["streams"] for r in result["streams"] + result["relay"]), result
    assert all(r["events"] == r["events_expected"] for r in result["relay"]), result["relay"]


@pytest.mark.slow
def test_serve(tiny_model_dir: str, tmp_path: Path) -> None:
    out = bench("serve", "--model", tiny_model_dir, "--json", str(tmp_path / "serve.json"))
    assert "Idle stack" in out and "TTFT by hop" in out and "| deliver |" in out
    rows = json.loads((tmp_path / "serve.json").read_text())["results"]
    assert {(r["target"], r["level"]) for r in rows} == {("conveyor", "2"), ("in-process", "2")}
    assert not any(r["errors"] for r in rows)


def test_soak(tmp_path: Path) -> None:
    out = bench("soak", "--workdir", str(tmp_path / "soak"), "--csv", str(tmp_path / "soak.csv"))
    assert "| succeeded | 30 |" in out and (tmp_path / "soak.csv").exists()


@pytest.mark.slow
def test_chaos(tmp_path: Path) -> None:
    out = bench("chaos", "--workdir", str(tmp_path / "chaos"))
    assert "| **lost** (never ended) | 0 |" in out


@pytest.mark.slow
def test_gpu_check_smoke() -> None:
    proc = subprocess.run(["bash", "bench/gpu_check.sh", "--smoke"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "| ours (bf16) | 2 |" in proc.stdout and "| transformers continuous batching (bf16) | 2 |" in proc.stdout
    assert "failed or not run" not in proc.stdout


def test_offline_batch(tiny_model_dir: str) -> None:
    """The in-process batch that bench.vllm_offline runs against vLLM: our side, with a shared system
    prompt served from the prefix cache (its warm-up requests have none)."""
    out = bench("vllm_offline", "--model", tiny_model_dir, "--system-words", "60", "--prefix-caching")
    res = json.loads(out.strip().splitlines()[-1])
    assert res["engine"] == "ours" and res["tokens"] == 4 * 4 and len(res["ids"]) == 4


def test_kv_cache(tiny_model_dir: str) -> None:
    out = bench("kv_cache", "--model", tiny_model_dir)
    res = json.loads(out.splitlines()[0])
    assert res["most_running"] == res["requests"] and res["paged_waste"] < res["dense_waste"]


@pytest.mark.slow
def test_cpu_per_token(tiny_model_dir: str, tmp_path: Path) -> None:
    out = bench("cpu_per_token", "--model", tiny_model_dir, "--json", str(tmp_path / "cpt.json"))
    assert "| conveyor | 1 |" in out and '"inference"' in out
    [run] = json.loads((tmp_path / "cpt.json").read_text())["runs"]
    assert run["tokens"] > 0 and not run["errored"], run


def test_compile_layers(tiny_model_dir: str) -> None:
    out = bench("compile_layers", "--model", tiny_model_dir)
    assert "eager bfloat16: layers" in out and "compiled bfloat16: layers" in out


def test_sampler() -> None:
    out = bench("sampler")
    assert "| temperature 1 |" in out and "| temperature 0.7, top_p 0.9 |" in out and "8 rows" in out


def test_attention() -> None:
    out = bench("attention")
    assert "| 64 | 1 |" in out and "| 64 | 8 |" in out
