"""Every benchmark's `--quick` run ends well: a benchmark that drifts from the code it measures fails here.
Speed is never asserted; only that each script runs through and reports what it measures.

Each test checks what its benchmark's command wrote. Most commands are a process of their own, run by their test.
Those that need torch and nothing else for a few seconds all run in one process, one after another, by bench.quick
(one interpreter and one import of torch for all: ~2 CPU-s each saved), the first time a test asks for one; their
tests form one xdist group (`TORCH_GROUP`), and only the runs of the tests selected are made (test_NAME reads the
run NAME)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu_worker.engine import cpu_kernels as ck
from tests.conftest import ROOT

# (their OpenMP threads sleep while they wait, as the suite's every process: tests/conftest.py) inductor compiles in
# this process rather than first starting a pool of compile workers (~1 s of CPU)
ENV = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": os.environ.get("TORCHINDUCTOR_COMPILE_THREADS", "1")}
TORCH_GROUP = pytest.mark.xdist_group("bench_torch")  # the tests of the runs made by one bench.quick process


class QuickRuns:
    """Each benchmark's `--quick` command; `out(name)` runs one and answers its output."""

    def __init__(self, tiny: str, tmp: Path, selected: set[str]) -> None:
        self.tmp = tmp
        self.py = py = [sys.executable, "-m"]
        # torch only and seconds each: run by bench.quick, those selected, in this order (compile_layers last: it
        # sets inductor's configuration for the whole process)
        self.groups: dict[str, dict[str, list[str]]] = {
            "torch": {
                "engine_contenders": ["engine", "generate", "--quick", "--model", tiny, "--json",
                                      str(tmp / "engine.json")],
                "engine_step_time": ["engine", "step", "--quick", "--model", tiny, "--batches", "1,4",
                                     "--kernels", "on,off", "--after-idle", "0.1", "--dtypes", "float32"],
                "offline_batch": ["vllm", "offline", "--quick", "--model", tiny, "--system-words", "60",
                                  "--prefix-caching"],
                "kv_cache": ["engine", "kv-cache", "--quick", "--model", tiny],
                "attention": ["engine", "attention", "--quick"],
                "gemm_shapes": ["engine", "gemm", "--quick"],
                "sampler": ["engine", "sampler", "--quick"],
                "invariance": ["engine", "invariance", "--quick", "--model", tiny],
                "lora": ["engine", "lora", "--quick", "--model", tiny, "--dtypes", "float32",
                         "--workdir", str(tmp / "lora")],
                "tokenizer": ["serve", "tokenizer", "--quick"],
                "per_token": ["engine", "per-token", "--quick", "--model", tiny],
                "speculative": ["engine", "speculative", "--quick", "--model", tiny],
                "compile_layers": ["engine", "compile", "--quick", "--model", tiny],
            },
        }
        self.runs = {
            "cpu_per_token": py + ["bench", "vllm", "serving", "--quick", "--model", tiny, "--json",
                                   str(tmp / "cpt.json")],
            "serve": py + ["bench", "serve", "load", "--quick", "--model", tiny, "--json", str(tmp / "serve.json")],
            "vllm_lora": py + ["bench", "vllm", "lora", "--quick", "--model", tiny, "--workdir",
                               str(tmp / "vllm-lora")],
            "chaos": py + ["bench", "faults", "chaos", "--quick", "--workdir", str(tmp / "chaos")],
            "drain": py + ["bench", "faults", "drain", "--quick"],
            "seeds": py + ["bench", "serve", "seeds", "--quick", "--model", tiny, "--jobs", "3", "--others", "9"],
            "from_zero": py + ["bench", "cold-start", "from-zero", "--quick", "--model", tiny, "--workdir",
                               str(tmp / "from-zero")],
            "gpu_check": ["bash", "bench/gpu_check.sh", "--smoke"],
            "plumbing": py + ["bench", "serve", "plumbing", "--quick", "--json", str(tmp / "plumbing.json")],
            "soak": py + ["bench", "soak", "--quick", "--model", tiny, "--workdir", str(tmp / "soak"), "--csv",
                          str(tmp / "soak.csv")],
            "redis_ops": py + ["bench", "serve", "redis", "--quick"],
            "cold_start": py + ["bench", "cold-start", "--quick", "--model", tiny],
            "batch": py + ["bench", "batch", "--quick", "--model", tiny],
            "fairness": py + ["bench", "fairness", "--quick", "--model", tiny, "--modes", "fair", "--json",
                              str(tmp / "fairness.json")],
        }
        self.selected = selected
        self.made: dict[str, subprocess.CompletedProcess[str]] = {}  # group -> its bench.quick process, once run

    def out(self, name: str) -> str:
        group = next((g for g, names in self.groups.items() if name in names), None)
        if group is not None:
            proc = self.made.get(group) or self._make(group, name)
            rc = self.tmp / group / f"{name}.rc"
            assert rc.exists(), f"{name}: not run (bench.quick: exit {proc.returncode})\n{proc.stderr[-4000:]}"
            code, _, why = rc.read_text().partition("\n")
            assert code == "0", f"{name}: exit {code}\n{why}\n{proc.stderr[-4000:]}"
            return (self.tmp / group / f"{name}.out").read_text()
        proc = run(self.runs[name])
        assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        return proc.stdout

    def _make(self, group: str, asked: str) -> subprocess.CompletedProcess[str]:
        """The group's runs whose tests are selected (and `asked`), in one bench.quick process."""
        spec = {n: argv for n, argv in self.groups[group].items() if n in self.selected or n == asked}
        self.made[group] = proc = run(self.py + ["bench.quick", str(self.tmp / group), json.dumps(spec)])
        return proc


def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="session")  # (not the module's: its tests other than TORCH_GROUP's may run in any worker)
def runs(request: pytest.FixtureRequest, tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> QuickRuns:
    here = Path(__file__)
    selected = {item.name.removeprefix("test_") for item in request.session.items if item.path == here}
    return QuickRuns(tiny_model_dir, tmp_path_factory.mktemp("bench-quick"), selected)


@TORCH_GROUP
def test_engine_contenders(runs: QuickRuns) -> None:
    out = runs.out("engine_contenders")
    for name in ("naive", "static", "hf-cb", "ours-fp32", "ours-bf16"):
        assert f"| {name}" in out
    assert "ours-fp32 greedy tokens == batch-1 `generate` for 2/2 requests" in out
    rows = json.loads((runs.tmp / "engine.json").read_text())["results"]
    assert {r["level"] for r in rows} == {"all", "poisson"}


@TORCH_GROUP
def test_engine_step_time(runs: QuickRuns) -> None:
    out = runs.out("engine_step_time")
    assert "batch   4 kernels on : decode step" in out and "batch   4 kernels off: decode step" in out
    assert "prefill step: warm" in out


@TORCH_GROUP
def test_gemm_shapes(runs: QuickRuns) -> None:
    out = runs.out("gemm_shapes")
    assert out.count("\n| 8 |") == 1 and "lm_head" in out
    assert ("/ packed" in out) == ck.supports_packed_gemm(torch.device("cpu"), torch.float32)


def test_redis_ops(runs: QuickRuns) -> None:
    out = runs.out("redis_ops")
    assert "chunk-step x32" in out and "per job:" in out


@pytest.mark.slow
def test_plumbing(runs: QuickRuns) -> None:
    runs.out("plumbing")
    result = json.loads((runs.tmp / "plumbing.json").read_text())
    assert result["accept"] and all(r["accepted_per_s"] > 0 for r in result["accept"])
    assert all(r["complete"] == r["streams"] for r in result["streams"] + result["relay"]), result
    assert all(r["events"] == r["events_expected"] for r in result["relay"]), result["relay"]


@pytest.mark.slow
def test_serve(runs: QuickRuns) -> None:
    out = runs.out("serve")
    assert "Idle stack" in out and "TTFT by hop" in out and "| deliver |" in out
    rows = json.loads((runs.tmp / "serve.json").read_text())["results"]
    assert {(r["target"], r["level"]) for r in rows} == {("conveyor", "2"), ("in-process", "2")}
    assert not any(r["errors"] for r in rows)


@pytest.mark.slow
def test_soak(runs: QuickRuns) -> None:
    out = runs.out("soak")
    assert "| succeeded | 30 |" in out and (runs.tmp / "soak.csv").exists()


@pytest.mark.slow
def test_chaos(runs: QuickRuns) -> None:
    out = runs.out("chaos")
    assert "| **lost** (never ended) | 0 |" in out


@pytest.mark.slow
def test_drain(runs: QuickRuns) -> None:
    out = runs.out("drain")
    assert "| where the job was once the worker stopped | rounds |" in out and "held by" not in out


@pytest.mark.slow
def test_seeds(runs: QuickRuns) -> None:
    out = runs.out("seeds")
    assert "| round | jobs | wall s | seeded texts as alone | all succeeded |" in out and "2 / 2 rounds held" in out


@pytest.mark.slow
def test_gpu_check_smoke(runs: QuickRuns) -> None:
    out = runs.out("gpu_check")
    assert "| ours (bf16) | 2 |" in out and "| transformers continuous batching (bf16) | 2 |" in out
    assert "failed or not run" not in out


@TORCH_GROUP
def test_offline_batch(runs: QuickRuns) -> None:
    """The in-process batch that bench.vllm_offline runs against vLLM: our side, with a shared system
    prompt served from the prefix cache (its warm-up requests have none)."""
    out = runs.out("offline_batch")
    res = json.loads(out.strip().splitlines()[-1])
    assert res["engine"] == "ours" and res["tokens"] == 4 * 4 and len(res["ids"]) == 4


@TORCH_GROUP
def test_kv_cache(runs: QuickRuns) -> None:
    out = runs.out("kv_cache")
    res = json.loads(out.splitlines()[0])
    assert res["most_running"] == res["requests"] and res["paged_waste"] < res["dense_waste"]


@pytest.mark.slow
def test_cpu_per_token(runs: QuickRuns) -> None:
    """Also the check that guidellm, the usual load tool, drives the stack unchanged: its backend check
    (GET /health) passes, and its streamed requests all succeed."""
    out = runs.out("cpu_per_token")
    assert "| conveyor | 1 |" in out and '"inference"' in out
    [run] = json.loads((runs.tmp / "cpt.json").read_text())["runs"]
    assert run["requests"] > 0 and run["tokens"] > 0 and not run["errored"], run


@TORCH_GROUP
def test_compile_layers(runs: QuickRuns) -> None:
    out = runs.out("compile_layers")
    assert "eager bfloat16: layers" in out and "compiled bfloat16: layers" in out


@TORCH_GROUP
def test_sampler(runs: QuickRuns) -> None:
    out = runs.out("sampler")
    assert "| temperature 1 |" in out and "| temperature 0.7, top_p 0.9 |" in out and "8 rows" in out


@TORCH_GROUP
def test_invariance(runs: QuickRuns) -> None:
    out = runs.out("invariance")
    assert "| bfloat16 | decode step, 4 rows, seeded top-p 0.9, ms |" in out and "| bfloat16 | prefill burst" in out


@pytest.mark.slow
def test_from_zero(runs: QuickRuns) -> None:
    out = runs.out("from_zero")
    assert "| empty (scaled to zero) |" in out and "| warm |" in out


@pytest.mark.slow
def test_vllm_lora(runs: QuickRuns) -> None:
    out = runs.out("vllm_lora")
    assert "| conveyor |" in out and "four / none" in out


@TORCH_GROUP
def test_lora(runs: QuickRuns) -> None:
    out = runs.out("lora")
    assert "| float32 | base |" in out and "| float32 | four adapters mixed |" in out


@TORCH_GROUP
def test_attention(runs: QuickRuns) -> None:
    out = runs.out("attention")
    assert "| 64 | 1 |" in out and "| 64 | 8 |" in out


@pytest.mark.slow
def test_fairness(runs: QuickRuns) -> None:
    """The fair mode only (FIFO is the same stack with FAIR_SHARE=false): a light tenant's jobs alone and
    under a heavy tenant's flood, all of them served."""
    out = runs.out("fairness")
    assert "| light TTFT p50 under the flood, s |" in out and "| heavy throughput, tok/s |" in out
    [run] = json.loads((runs.tmp / "fairness.json").read_text())["runs"]
    assert run["mode"] == "fair" and run["failed"] == 0 and run["heavy_tok_s"] > 0, run


@pytest.mark.slow
def test_batch(runs: QuickRuns) -> None:
    out = runs.out("batch")
    assert "| batch |" in out and "| interactive |" in out and "interactive TTFT p50/p95" in out


@TORCH_GROUP
def test_per_token(runs: QuickRuns) -> None:
    out = runs.out("per_token")
    assert "| json_schema |" in out and "| logprobs, top 5 |" in out and "schema compile: " in out


@TORCH_GROUP
def test_tokenizer(runs: QuickRuns) -> None:
    out = runs.out("tokenizer")
    assert "| prompts | tokens each |" in out and "\n| 4 | " in out


@TORCH_GROUP
def test_speculative(runs: QuickRuns) -> None:
    out = runs.out("speculative")
    assert "| edit a text | 2 |" in out and "| open questions | 2 |" in out and "drafts kept" in out


@pytest.mark.slow
def test_cold_start(runs: QuickRuns) -> None:
    out = runs.out("cold_start")
    assert "| worker live, s (range) |" in out and "\n| float32 | " in out
