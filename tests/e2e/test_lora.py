"""LoRA adapters end to end, on one Redis node and on the local cluster: a request names an adapter in `model` on
every route and gets PEFT's own greedy text (float32, the tests' stacks), alone and mixed with the base model and
other adapters under concurrency; adapters are listed with their parent; one loaded at run time is served at once
and, unloaded, answers 404 model_not_found; a bad one is refused at load with a 400 saying why. And on the default
model: its adapter's chat answer equals PEFT's."""

from __future__ import annotations

import asyncio
import json
import shutil
from functools import cache
from typing import Any

import httpx
import openai
import pytest
import torch

from harness.stack import Stack
from tests.helpers import submit, wait

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at"]
N = 12


@cache
def _peft(base_dir: str, adapter: str | None) -> Any:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return (PeftModel.from_pretrained(model, adapter) if adapter else model).eval()


@cache
def _tokenizer(base_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base_dir)


def peft_text(base_dir: str, adapter: str | None, prompt: str | list[int], n: int = N) -> str:
    """PEFT's greedy continuation of `prompt` (text, or the ids of a chat prompt), as text."""
    tok = _tokenizer(base_dir)
    ids = torch.tensor([tok(prompt).input_ids if isinstance(prompt, str) else prompt])
    with torch.inference_mode():
        out = _peft(base_dir, adapter).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                                do_sample=False, pad_token_id=tok.eos_token_id, eos_token_id=None)
    return str(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))


def _model_ids(url: str) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}


@pytest.fixture
def plumbing_oai(plumbing_stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=plumbing_stack.url + "/v1", api_key="unused", max_retries=0)


async def _complete(client: openai.AsyncOpenAI, model: str, prompt: str) -> str:
    r = await client.completions.create(model=model, prompt=prompt, max_tokens=N, temperature=0,
                                        extra_body={"ignore_eos": True})
    return r.choices[0].text


@pytest.mark.parametrize("plumbing_stack", ["single", "cluster"], indirect=True)
async def test_adapters_and_the_base_mixed_under_concurrency_equal_peft(plumbing_stack: Stack,
                                                                       plumbing_oai: openai.AsyncOpenAI,
                                                                       tiny_model_dir: str,
                                                                       tiny_loras: dict[str, str]) -> None:
    models = _model_ids(plumbing_stack.url)
    base = next(i for i, m in models.items() if m["parent"] is None)
    assert {i: m["parent"] for i, m in models.items() if m["parent"]} == {"tiny-all": base, "tiny-attn": base}
    assert models["tiny-all"]["root"] == tiny_loras["tiny-all"]
    served = {base: None, "tiny-all": tiny_loras["tiny-all"], "tiny-attn": tiny_loras["tiny-attn"]}
    runs = [(name, p) for p in PROMPTS for name in served] * 2
    got = await asyncio.gather(*(_complete(plumbing_oai, name, p) for name, p in runs))
    want = {(name, p): peft_text(tiny_model_dir, path, p) for name, path in served.items() for p in PROMPTS}
    assert got == [want[r] for r in runs]
    assert want[("tiny-all", PROMPTS[0])] != want[(base, PROMPTS[0])]  # the adapter changes the text


@pytest.mark.parametrize("plumbing_stack", ["single", "cluster"], indirect=True)
async def test_an_adapter_is_named_in_model_on_every_route(plumbing_stack: Stack, plumbing_oai: openai.AsyncOpenAI,
                                                          tiny_model_dir: str, tiny_loras: dict[str, str]) -> None:
    prompt = PROMPTS[1]
    want = peft_text(tiny_model_dir, tiny_loras["tiny-all"], prompt)
    with httpx.Client(base_url=plumbing_stack.url, timeout=60) as sync:
        job = submit(sync, model="tiny-all", prompt=prompt, max_tokens=N, temperature=0, ignore_eos=True)
        job = wait(sync, job["id"])
    assert job["text"] == want and job["model"] == "tiny-all"
    async with httpx.AsyncClient(base_url=plumbing_stack.url, timeout=60) as api:
        responses = (await api.post("/v1/responses", json={"model": "tiny-all", "input": "Hi", "max_output_tokens": 4,
                                                           "temperature": 0})).json()
        assert responses["model"] == "tiny-all" and responses["status"] == "incomplete"  # (its 4 tokens)
        message = await api.post("/v1/messages", json={"model": "tiny-attn", "max_tokens": 4,
                                                       "messages": [{"role": "user", "content": "Hi"}]})
        assert message.status_code == 200 and message.json()["model"] == "tiny-attn"
        chat = await plumbing_oai.chat.completions.create(model="tiny-attn", max_tokens=4,
                                                          messages=[{"role": "user", "content": "Hi"}])
        assert chat.model == "tiny-attn"
        for route, body in (("/v1/jobs", {"prompt": "x"}), ("/v1/chat/completions", {"messages": [
                {"role": "user", "content": "x"}]}), ("/v1/completions", {"prompt": "x"}),
                ("/v1/responses", {"input": "x"}), ("/tokenize", {"prompt": "x"})):
            r = await api.post(route, json={**body, "model": "no-such-adapter"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", route


@pytest.mark.parametrize("plumbing_stack", ["single", "cluster"], indirect=True)
async def test_an_adapter_loaded_at_run_time_is_served_until_unloaded(plumbing_stack: Stack,
                                                                      plumbing_oai: openai.AsyncOpenAI,
                                                                      tiny_model_dir: str,
                                                                      tiny_loras: dict[str, str],
                                                                      tmp_path: Any) -> None:
    async with httpx.AsyncClient(base_url=plumbing_stack.url, timeout=60) as api:
        bad = await api.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path)})
        assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
        again = await api.post("/v1/load_lora_adapter", json={"lora_name": "tiny-all", "lora_path": str(tmp_path)})
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        malformed = shutil.copytree(tiny_loras["tiny-late"], tmp_path / "malformed")
        config = json.loads((malformed / "adapter_config.json").read_text())
        (malformed / "adapter_config.json").write_text(json.dumps({**config, "rank_pattern": ["x"]}))
        for body in ({"lora_name": "malformed", "lora_path": str(malformed)}, {"lora_name": "no-path"}):
            r = await api.post("/v1/load_lora_adapter", json=body)
            assert r.status_code == 400, r.text  # a config of the wrong shapes, a body without its path: as vLLM
        r = await api.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": tiny_loras["tiny-late"]})
        assert r.status_code == 200, r.text
        try:
            assert _model_ids(plumbing_stack.url)["late"]["root"] == tiny_loras["tiny-late"]
            got = await _complete(plumbing_oai, "late", PROMPTS[2])
            assert got == peft_text(tiny_model_dir, tiny_loras["tiny-late"], PROMPTS[2])
            line = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
                    "body": {"model": "late", "prompt": "x", "max_tokens": 1}}  # a batch line may name it too
            f = await api.post("/v1/files", files={"file": ("in.jsonl", json.dumps(line).encode() + b"\n")},
                               data={"purpose": "batch"})
            batch = (await api.post("/v1/batches", json={"input_file_id": f.json()["id"], "endpoint": "/v1/completions",
                                                         "completion_window": "24h"})).json()
            assert batch["request_counts"] == {"total": 1, "completed": 0, "failed": 0}, batch
            await api.post(f"/v1/batches/{batch['id']}/cancel")
        finally:
            assert (await api.post("/v1/unload_lora_adapter", json={"lora_name": "late"})).status_code == 200
        assert "late" not in _model_ids(plumbing_stack.url)
        with pytest.raises(openai.NotFoundError):
            await _complete(plumbing_oai, "late", PROMPTS[2])
        gone = await api.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
        assert gone.status_code == 404
        fixed = await api.post("/v1/unload_lora_adapter", json={"lora_name": "tiny-all"})
        assert fixed.status_code == 400 and "LORA_MODULES" in fixed.json()["error"]["message"]


def test_the_default_models_adapter_answers_as_peft_does(stack: Stack, model_path: str, smol_lora: str) -> None:
    oai = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    tok = _tokenizer(model_path)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    for model, adapter in (("smol-lora", smol_lora), (oai.models.list().data[0].id, None)):
        r = oai.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=24,
                                        extra_body={"ignore_eos": True})
        assert r.choices[0].message.content == peft_text(model_path, adapter, ids, 24).strip(), model


async def test_an_adapter_replaced_unloaded_or_unreadable_answers_as_the_clients_error(
        tiny_stack: Stack, tiny_model_dir: str, tiny_loras: dict[str, str], tmp_path: Any) -> None:
    """vLLM's `load_inplace` replaces an adapter loaded at run time (the next jobs run the new one); a served model's
    name and a relative path are refused with a reason; and jobs that can no longer run on their adapter (unloaded
    while they waited, or whose directory this worker cannot read) fail as the request's error (a 400, never started:
    not a 503 that clients retry), each alone."""
    oai = openai.AsyncOpenAI(base_url=tiny_stack.url + "/v1", api_key="unused", max_retries=0)
    async with httpx.AsyncClient(base_url=tiny_stack.url, timeout=60) as api:
        async def load(name: str, path: str, **more: Any) -> httpx.Response:
            return await api.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path, **more})

        r = await load(_model_ids(tiny_stack.url)["tiny-all"]["parent"], tiny_loras["tiny-late"])
        assert r.status_code == 400 and "served model's name" in r.json()["error"]["message"], r.text
        r = await load("relative", "tiny-late")
        assert r.status_code == 400 and "absolute" in r.json()["error"]["message"], r.text
        r = await load("tiny-all", tiny_loras["tiny-late"], load_inplace=True)
        assert r.status_code == 400 and "LORA_MODULES" in r.json()["error"]["message"], r.text

        assert (await load("swap", tiny_loras["tiny-late"])).status_code == 200
        try:
            assert await _complete(oai, "swap", PROMPTS[0]) == peft_text(tiny_model_dir, tiny_loras["tiny-late"],
                                                                         PROMPTS[0])
            assert (await load("swap", tiny_loras["tiny-attn"])).status_code == 400  # without load_inplace
            assert (await load("swap", tiny_loras["tiny-attn"], load_inplace=True)).status_code == 200
            assert await _complete(oai, "swap", PROMPTS[0]) == peft_text(tiny_model_dir, tiny_loras["tiny-attn"],
                                                                         PROMPTS[0])
            copy = shutil.copytree(tiny_loras["tiny-late"], tmp_path / "copy")
            assert (await load("vanishing", str(copy))).status_code == 200
            shutil.rmtree(copy)  # (as a volume the API has and the inference pods have not)
            with pytest.raises(openai.BadRequestError, match="cannot be read here"):
                await _complete(oai, "vanishing", PROMPTS[0])

            # queued while the inference worker is held, then unloaded: they fail unstarted, the others run
            sync = httpx.Client(base_url=tiny_stack.url, timeout=60)
            tiny_stack.pause("inference")
            try:
                queued = [submit(sync, prompt=p, model="swap", max_tokens=4)["id"] for p in PROMPTS]
                base = submit(sync, prompt=PROMPTS[0], max_tokens=4)["id"]
                assert (await api.post("/v1/unload_lora_adapter", json={"lora_name": "swap"})).status_code == 200
            finally:
                tiny_stack.resume("inference")
            for job_id in queued:
                job = wait(sync, job_id)
                assert job["status"] == "failed" and job["started_at"] is None, job
                assert "no longer served" in job["error"]
            assert wait(sync, base)["status"] == "succeeded"
        finally:
            for name in ("swap", "vanishing"):
                await api.post("/v1/unload_lora_adapter", json={"lora_name": name})
