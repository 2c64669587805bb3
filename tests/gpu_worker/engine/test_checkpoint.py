"""The engine loads a Llama-family checkpoint from its files without transformers (models/checkpoint.py) and
computes what transformers' own model computes from the same files; what that reader does not handle is
loaded through transformers as before."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu_worker.engine import EngineConfig, LLMEngine
from tests.conftest import ROOT
from tests.gpu_worker.engine.test_engine import _tiny, prefill_then_decode


def _saved(arch: str, tmp_path: Path, tie: bool = False) -> tuple[str, torch.nn.Module]:
    model = _tiny(arch)
    if tie:
        model.config.tie_word_embeddings = True
        model.tie_weights()
    model.save_pretrained(tmp_path)
    return str(tmp_path), model


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "llama-tied"])
def test_read_without_transformers_computes_what_transformers_does(arch: str, tmp_path: Path) -> None:
    path, model = _saved(arch.removesuffix("-tied"), tmp_path, tie=arch.endswith("-tied"))
    ids = [5, 17, 99, 300, 42, 7, 301, 11]
    with torch.inference_mode():
        ref = model(torch.tensor([ids])).logits[0, -2:]
    eng = LLMEngine(EngineConfig(model=path, dtype="float32"))
    assert not isinstance(eng.runner.hf_model, torch.nn.Module)  # read by models/checkpoint.py
    prefill, decode = prefill_then_decode(eng, ids)
    assert (prefill - ref[0]).abs().max().item() < 1e-4 and (decode - ref[1]).abs().max().item() < 1e-4
    assert eng.eos_token_ids == (2,)


def test_rope_scaling_goes_through_transformers(tmp_path: Path) -> None:
    path, _ = _saved("llama", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = 10000.0
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    eng = LLMEngine(EngineConfig(model=path, dtype="float32"))
    assert isinstance(eng.runner.hf_model, torch.nn.Module)


def test_an_inference_engine_imports_no_transformers(tiny_model_dir: str) -> None:
    code = ("import sys; from gpu_worker.engine import EngineConfig, LLMEngine; from shared.schemas import Request; "
            f"e = LLMEngine(EngineConfig(model={tiny_model_dir!r})); "
            "e.add_request(Request('a', [5, 6, 7], max_tokens=2)); "
            "[e.step() for _ in range(3)]; print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr[-2000:]
