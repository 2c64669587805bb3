"""Several models in one deployment (MODELS), on one Redis node and on the local cluster: two checkpoints and an
adapter of each, every one named in `model`, each model with a queue and an inference pool of its own. Mixed
under concurrency, every job's greedy text equals transformers' (PEFT's for an adapter) on the model it named; a
backlog on one model never delays another's jobs; the second model's pool (`min_replicas` 0) starts when a job
waits for it and drains back to zero when idle, while the default model's stays; nothing is lost."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator

import httpx
import openai
import pytest

from harness.models import make_lora_adapter, make_tiny_model
from shared import names
from tests.conftest import REFERENCE_DTYPE, Stack, start_stack, stop_stack
from tests.e2e.test_lora import PROMPTS, N, peft_text
from tests.helpers import submit, until, wait

SECOND = "tiny-b"
SECOND_POOL = names.inference_pool(SECOND)


@pytest.fixture(scope="module")
def second_model(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> dict[str, str]:
    """A second checkpoint (other weights, other width) and an adapter of it."""
    tmp = tmp_path_factory.mktemp("second-model")
    path = make_tiny_model(tmp / "model", model_path, seed=7, hidden_size=128)
    return {"path": path, "lora": make_lora_adapter(tmp / "lora", path, 5, r=4)}


@pytest.fixture(scope="module", params=["single", "cluster"])
def models_stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str,
                 tiny_loras: dict[str, str], second_model: dict[str, str]) -> Iterator[Stack]:
    args = [] if request.param == "single" else ["--redis-cluster", "3"]  # its own redis-server, or local cluster
    models = [{"name": "tiny-a", "path": tiny_model_dir},
              {"name": SECOND, "path": second_model["path"], "min_replicas": 0, "max_replicas": 1}]
    loras = [{"name": "tiny-all", "path": tiny_loras["tiny-all"]},
             {"name": "b-lora", "path": second_model["lora"], "base_model_name": SECOND}]
    stack = start_stack(tmp_path_factory.mktemp(f"models-{request.param}"), "", "", args=args, autoscale=True,
                        extra={"MODELS": json.dumps(models), "LORA_MODULES": json.dumps(loras),
                               "AUTOSCALE_PERIOD_S": "0.5", "SCALE_IN_COOLDOWN_S": "3",
                               **REFERENCE_DTYPE})  # (compared with transformers' and PEFT's float32 text)
    yield stack
    stop_stack(stack)


def _workers(stack: Stack, pool: str) -> list[int]:
    return stack.worker_pids(pool)


async def _complete(client: openai.AsyncOpenAI, model: str, prompt: str) -> str:
    r = await client.completions.create(model=model, prompt=prompt, max_tokens=N, temperature=0,
                                        extra_body={"ignore_eos": True})
    return r.choices[0].text


def test_every_model_and_adapter_mixed_equals_transformers(models_stack: Stack, tiny_model_dir: str,
                                                           tiny_loras: dict[str, str],
                                                           second_model: dict[str, str]) -> None:
    listed = {m["id"]: m for m in httpx.get(f"{models_stack.url}/v1/models", timeout=10).json()["data"]}
    assert {i: m["parent"] for i, m in listed.items()} == {"tiny-a": None, SECOND: None, "tiny-all": "tiny-a",
                                                         "b-lora": SECOND}
    assert listed[SECOND]["max_model_len"] == 1024  # MAX_MODEL_LEN caps each model's own context
    served = {"tiny-a": (tiny_model_dir, None), "tiny-all": (tiny_model_dir, tiny_loras["tiny-all"]),
              SECOND: (second_model["path"], None), "b-lora": (second_model["path"], second_model["lora"])}
    runs = [(name, p) for p in PROMPTS for name in served] * 2

    async def all_of() -> list[str]:  # the client closed in the loop it ran in (tests/api/test_openai.py says why)
        async with openai.AsyncOpenAI(base_url=models_stack.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=240) as client:
            return await asyncio.gather(*(_complete(client, name, p) for name, p in runs))

    got = asyncio.run(all_of())
    want = {(name, p): peft_text(base, lora, p) for name, (base, lora) in served.items() for p in PROMPTS}
    assert got == [want[r] for r in runs]
    assert len({want[(name, PROMPTS[0])] for name in served}) == len(served)  # each names another model
    with httpx.Client(base_url=models_stack.url, timeout=60) as c:  # and a job's record names what it asked for
        job = wait(c, submit(c, prompt=PROMPTS[0], model="b-lora", max_tokens=N, temperature=0,
                                ignore_eos=True)["id"])
        assert job["model"] == "b-lora" and job["text"] == want[("b-lora", PROMPTS[0])]
        job = wait(c, submit(c, prompt=PROMPTS[1], model=SECOND, max_tokens=N, temperature=0, ignore_eos=True)["id"])
        assert job["model"] == SECOND and job["text"] == want[(SECOND, PROMPTS[1])]
    chat = httpx.post(f"{models_stack.url}/v1/chat/completions", timeout=60, json={
        "model": SECOND, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["model"] == SECOND


def test_a_backlog_on_one_model_does_not_delay_another(models_stack: Stack) -> None:
    with httpx.Client(base_url=models_stack.url, timeout=60) as c:
        first = submit(c, prompt="Wake up", model=SECOND, max_tokens=4)
        assert wait(c, first["id"], timeout=180)["status"] == "succeeded"
        [pid] = until("the second model's worker", lambda: _workers(models_stack, SECOND_POOL), timeout=30)
        os.kill(pid, signal.SIGSTOP)  # the second model's only worker takes nothing more while stopped
        try:
            backlog = [submit(c, prompt=f"Backlog {i}:", model=SECOND, max_tokens=32, ignore_eos=True)
                       for i in range(40)]
            ahead = [submit(c, prompt=f"Meanwhile {i}:", model="tiny-a", max_tokens=8, ignore_eos=True)
                     for i in range(4)]
            ended = [wait(c, j["id"], timeout=60) for j in ahead]
            assert [e["status"] for e in ended] == ["succeeded"] * 4
            assert all(c.get(f"/v1/jobs/{j['id']}").json()["status"] in ("queued", "running") for j in backlog)
            signals = c.get("/scaling", params={"model": SECOND}).json()
            assert signals[names.INFERENCE_POOL]["lag"] > 0  # the second model's queue, under `inference`
        finally:
            os.kill(pid, signal.SIGCONT)
        done = [wait(c, j["id"], timeout=180) for j in backlog]
        assert [e["status"] for e in done] == ["succeeded"] * 40
        assert all(e["usage"]["completion_tokens"] == 32 for e in done)


def test_the_second_models_pool_drains_to_zero_and_comes_back(models_stack: Stack) -> None:
    until("the idle second pool to drain to zero", lambda: not _workers(models_stack, SECOND_POOL), timeout=90,
          every=0.25)
    with httpx.Client(base_url=models_stack.url, timeout=60) as c:
        ready = c.get("/readyz")
        assert ready.status_code == 200 and ready.json()["workers"][SECOND_POOL] == 0
        assert ready.json()["workers"][names.INFERENCE_POOL] == 1  # the default model's pool stays
        job = submit(c, prompt="From zero:", model="b-lora", max_tokens=8, ignore_eos=True)
        assert job["status"] == "queued"
        assert wait(c, job["id"], timeout=180)["status"] == "succeeded"
    until("the second pool to drain again", lambda: not _workers(models_stack, SECOND_POOL), timeout=90, every=0.25)
    assert len(_workers(models_stack, names.INFERENCE_POOL)) == 1
