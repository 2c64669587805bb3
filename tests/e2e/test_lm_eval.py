"""lm-eval against conveyor: a tiny multiple-choice task (tests/e2e/lmeval_task, local data, no hub) scored
by lm-eval's own `hf` model in-process, then by its `local-completions` model against the stack's
/v1/completions (token-id prompts, batched, `echo: true`, `logprobs: 1`, `max_tokens: 1`). Both run the
default model in float32 (the test stack's DTYPE), so per-token logprobs agree to ~1e-4 and every pick,
hence acc and acc_norm, must be the same. The reference run goes on in a process of its own, once, in the worker
that runs the shared stack's tests (the module joins their group)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

lm_eval = pytest.importorskip("lm_eval")
pytestmark = pytest.mark.xdist_group("stack")  # `hf_run` once, beside the stack its other test uses

from tests.conftest import ROOT, Stack  # noqa: E402

TASK = "conveyor_tinymc"
TASK_DIR = Path(__file__).resolve().parent / "lmeval_task"
LL_TOL = 1e-3  # a continuation's summed logprob (a few tokens), hf in-process vs the server


def evaluate(model: str, model_args: dict[str, Any], batch_size: int) -> dict[str, Any]:
    """One lm-eval run of the task: its results row and its samples by doc id."""
    from lm_eval.tasks import TaskManager

    with pytest.MonkeyPatch.context() as mp:  # the model and the data are local: never ask a hub
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], batch_size=batch_size,
                                      device="cpu", task_manager=TaskManager(include_path=str(TASK_DIR)),
                                      log_samples=True, bootstrap_iters=0)
    assert out is not None
    return {"results": out["results"][TASK], "samples": {s["doc_id"]: s for s in out["samples"][TASK]}}


def hf_reference(model_path: str) -> dict[str, Any]:
    """lm-eval's own `hf` model in this process, as JSON: its results row, and each sample's per-choice
    (loglikelihood, greedy) pairs and picks."""
    out = evaluate("hf", {"pretrained": model_path, "dtype": "float32"}, batch_size=8)
    return {"results": {k: v for k, v in out["results"].items() if isinstance(v, (int, float, str))},
            "samples": {str(d): {"filtered_resps": [[float(r[0]), bool(r[1])] for r in s["filtered_resps"]],
                                 "acc": float(s["acc"]), "acc_norm": float(s["acc_norm"])}
                        for d, s in out["samples"].items()}}


@pytest.fixture(scope="module")
def hf_run(model_path: str) -> dict[str, Any]:
    code = ("import json, sys; from tests.e2e.test_lm_eval import hf_reference; "
            "print(json.dumps(hf_reference(sys.argv[1])))")
    proc = subprocess.run([sys.executable, "-c", code, model_path], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["samples"] = {int(d): s for d, s in out["samples"].items()}
    return out  # type: ignore[no-any-return]


def test_hf_reference(hf_run: dict[str, Any]) -> None:
    """The reference run: all 20 questions scored, some right and some wrong (a task that tells models apart)."""
    res = hf_run["results"]
    assert res["sample_len"] == 20
    assert 0.0 < res["acc,none"] < 1.0, res
    assert "acc_norm,none" in res


def test_local_completions_matches_hf(stack: Stack, model_path: str, hf_run: dict[str, Any]) -> None:
    served = httpx.get(f"{stack.url}/v1/models", timeout=10).json()["data"][0]["id"]
    api_run = evaluate("local-completions", {
        "model": served, "base_url": f"{stack.url}/v1/completions", "tokenizer": model_path,
        "tokenizer_backend": "huggingface", "num_concurrent": 2, "max_retries": 1,  # a 4xx fails at once
    }, batch_size=4)  # several token-id prompts per request: choices matched back by `index`

    mismatches = []
    for doc_id, ref in sorted(hf_run["samples"].items()):
        got = api_run["samples"][doc_id]
        ref_ll = [float(r[0]) for r in ref["filtered_resps"]]
        got_ll = [float(r[0]) for r in got["filtered_resps"]]
        ref_greedy = [bool(r[1]) for r in ref["filtered_resps"]]
        got_greedy = [bool(r[1]) for r in got["filtered_resps"]]
        if (len(ref_ll) != len(got_ll) or any(not math.isclose(a, b, abs_tol=LL_TOL) for a, b in zip(ref_ll, got_ll))
                or ref_greedy != got_greedy or ref["acc"] != got["acc"] or ref["acc_norm"] != got["acc_norm"]):
            mismatches.append(f"doc {doc_id}: hf {ref_ll} greedy {ref_greedy} / api {got_ll} greedy {got_greedy}")
    assert not mismatches, "per-choice loglikelihoods differ:\n" + "\n".join(mismatches)

    for metric in ("acc,none", "acc_norm,none"):
        if metric in hf_run["results"]:
            assert api_run["results"][metric] == hf_run["results"][metric], metric
