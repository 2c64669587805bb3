"""LoRA adapters in the engine: greedy float32 output equals PEFT's own, token for token, for each adapter alone and
for adapters and the base mixed in one batch; a row's tokens do not depend on the rows beside it (bfloat16 too);
the prefix cache never serves K/V across adapters; at most MAX_LORAS resident, a request waiting for a slot; a bad
adapter fails its own request, at load, and nothing else."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gpu_worker.engine import EngineConfig, LLMEngine
from harness.models import make_lora_adapter
from shared.lora import AdapterError, Dims, check_adapter, parse_modules
from shared.schemas import Request
from tests.gpu_worker.engine.test_engine import greedy, run

Reference = dict[tuple[str | None, int], list[int]]
PROMPTS = [[1, 450, 3290, 310, 3681, 338], [1, 1724, 338, 263, 2107, 1470, 29973, 13], [1, 29871, 13, 4013, 338],
           [1, 3532, 9312, 29901, 1724, 4943], [1, 3148, 1001, 29901, 910, 338, 263, 1243, 29889]]
N = 24


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Three adapters of the tiny model: all projections at rank 8 with down_proj at 4 (rank_pattern); attention
    alone at rank 16 with rsLoRA; the MLP alone at rank 64 with an alpha_pattern."""
    tmp = tmp_path_factory.mktemp("loras")
    return {
        "all": make_lora_adapter(tmp / "all", tiny_model_dir, 1, r=8, rank_pattern={"down_proj": 4}),
        "attn": make_lora_adapter(tmp / "attn", tiny_model_dir, 2, r=16, alpha=8, use_rslora=True,
                                  target_modules=["q_proj", "v_proj", "o_proj"]),
        "mlp": make_lora_adapter(tmp / "mlp", tiny_model_dir, 3, r=64, alpha=32, alpha_pattern={"up_proj": 64},
                                 target_modules=["gate_proj", "up_proj", "down_proj"]),
    }


def peft_greedy(base_dir: str, adapter: str | None, prompt: list[int], n: int = N) -> list[int]:
    """PEFT's own greedy continuation in float32 (the base model's alone when `adapter` is None)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.eval().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                    pad_token_id=0, eos_token_id=None)
    return list(out[0, len(prompt):].tolist())


def on(name: str | None, paths: dict[str, str], rid: str, prompt: list[int], n: int = N, **kw: object) -> Request:
    req = greedy(rid, prompt, n, **kw)
    if name is not None:
        req.lora, req.lora_path = name, paths[name]
    return req


@pytest.fixture(scope="module")
def reference(tiny_model_dir: str, adapters: dict[str, str]) -> Reference:
    return {(name, i): peft_greedy(tiny_model_dir, adapters.get(name) if name else None, p)
            for name in (None, "all", "attn", "mlp") for i, p in enumerate(PROMPTS[:3])}


@pytest.fixture
def engine(tiny_model_dir: str) -> Iterator[LLMEngine]:
    yield LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", max_num_seqs=32, max_loras=4, max_lora_rank=64))


def test_each_adapter_alone_equals_peft(engine: LLMEngine, adapters: dict[str, str],
                                        reference: Reference) -> None:
    for name in ("all", "attn", "mlp"):
        got = run(engine, [on(name, adapters, f"{name}-0", PROMPTS[0])])
        assert got[f"{name}-0"] == reference[(name, 0)], name
        assert reference[(name, 0)] != reference[(None, 0)]  # the adapter changes the output: the test can fail


def test_adapters_and_the_base_mixed_in_one_batch_equal_peft(engine: LLMEngine, adapters: dict[str, str],
                                                             reference: Reference) -> None:
    reqs = [on(name, adapters, f"{name}-{i}", p) for i, p in enumerate(PROMPTS[:3]) for name in
            (None, "all", "attn", "mlp")]
    arrivals = {r.id: k % 3 for k, r in enumerate(reqs)}  # some join while others decode: prefill and decode mixed
    got = run(engine, reqs, arrivals)
    for i in range(3):
        for name in (None, "all", "attn", "mlp"):
            assert got[f"{name}-{i}"] == reference[(name, i)], (name, i)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_rows_tokens_do_not_depend_on_the_rows_beside_it(tiny_model_dir: str, adapters: dict[str, str],
                                                           dtype: str) -> None:
    """Seeded sampling under an adapter gives the same tokens alone and among rows of other adapters and the
    base, prefilled in other chunks (batch invariance, in the default dtype too)."""
    if dtype == "bfloat16" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU has no bfloat16 instructions")
    config = EngineConfig(model=tiny_model_dir, dtype=dtype, max_num_seqs=32, max_num_batched_tokens=64,
                          max_lora_rank=64)

    def sampled(rid: str, name: str | None, prompt: list[int]) -> Request:
        req = on(name, adapters, rid, prompt, 16, seed=7)
        req.temperature = 0.8
        return req

    alone = run(LLMEngine(config), [sampled("x", "all", PROMPTS[3])])["x"]
    crowd = [sampled(f"o{k}", name, PROMPTS[k % 5]) for k, name in enumerate([None, "attn", "mlp", "all"] * 5)]
    got = run(LLMEngine(config), [*crowd, sampled("x", "all", PROMPTS[3])], {"x": 2})
    assert got["x"] == alone


def test_the_prefix_cache_serves_no_kv_across_adapters(engine: LLMEngine, tiny_model_dir: str,
                                                       adapters: dict[str, str]) -> None:
    long = PROMPTS[1] * 6  # several full blocks: a prefix the cache would serve
    base = run(engine, [on(None, adapters, "base", long)])["base"]
    under = run(engine, [on("all", adapters, "all", long)])["all"]
    again = run(engine, [on("all", adapters, "all2", long)])["all2"]  # served its own adapter's cached blocks
    assert under == again == peft_greedy(tiny_model_dir, adapters["all"], long)
    assert base == peft_greedy(tiny_model_dir, None, long) != under


def drain(engine: LLMEngine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.error is None, o.error
            out.setdefault(o.id, []).extend(o.token_ids)
    return out


def test_at_most_max_loras_resident_and_a_request_waits_for_a_slot(tiny_model_dir: str, adapters: dict[str, str],
                                                                   reference: Reference) -> None:
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", max_num_seqs=32, max_loras=1,
                                    max_lora_rank=64))
    for r in (on("all", adapters, "a", PROMPTS[0]), on("attn", adapters, "b", PROMPTS[1]),
              on(None, adapters, "c", PROMPTS[2])):
        engine.add_request(r)
    assert engine.num_waiting == 3 and [r.id for r in engine.lora_waiting] == ["b"]  # "all" holds the one slot
    got = drain(engine)
    assert got["a"] == reference[("all", 0)] and got["b"] == reference[("attn", 1)] and got["c"] == reference[(None, 2)]
    assert engine.loras.loads == 2 and engine.loras.evictions == 1 and list(engine.loras.resident) == ["attn"]
    assert engine.loras.held == {}


def test_an_adapter_written_anew_in_its_folder_is_read_again(tiny_model_dir: str, adapters: dict[str, str],
                                                              reference: Reference, tmp_path: Path) -> None:
    """A retrained adapter saved over the old one (unloaded, then loaded again from the same folder): its next
    request reads the new files (vLLM's unload drops the old weights), and no prefix-cache entry of the old one
    serves it."""
    folder = tmp_path / "retrained"
    shutil.copytree(adapters["all"], folder)
    paths = {"all": str(folder)}
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", max_num_seqs=32, max_loras=2,
                                    max_lora_rank=64))
    engine.add_request(on("all", paths, "a", PROMPTS[0]))
    assert drain(engine)["a"] == reference[("all", 0)]
    old_salt = engine.loras.resident["all"].salt
    shutil.rmtree(folder)
    shutil.copytree(adapters["attn"], folder)  # other weights, the same folder and name
    engine.add_request(on("all", paths, "b", PROMPTS[1]))
    assert drain(engine)["b"] == reference[("attn", 1)]
    assert engine.loras.loads == 2 and engine.loras.resident["all"].salt != old_salt


def _broken(src: str, tmp: Path, name: str) -> str:
    out = tmp / name
    shutil.copytree(src, out)
    return str(out)


def test_a_bad_adapter_fails_its_own_request_alone(engine: LLMEngine, adapters: dict[str, str], tmp_path: Path,
                                                   reference: Reference) -> None:
    bad = {"missing": str(tmp_path / "nowhere")}
    bad["dora"] = _broken(adapters["all"], tmp_path, "dora")
    cfg = json.loads(Path(bad["dora"], "adapter_config.json").read_text())
    Path(bad["dora"], "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    bad["rank"] = adapters["mlp"]  # rank 64, above a MAX_LORA_RANK of 32 below
    bad["shape"] = _broken(adapters["all"], tmp_path, "shape")
    (Path(bad["shape"]) / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    engine.config.max_lora_rank = 32
    engine._loras = None
    reqs = [greedy(name, PROMPTS[0], N) for name in bad]
    for r in reqs:
        r.lora, r.lora_path = r.id, bad[r.id]
    errors: dict[str, str] = {}
    for r in [*reqs, on("all", adapters, "good", PROMPTS[0])]:
        engine.add_request(r)
    tokens: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            if o.error:
                errors[o.id] = o.error
            elif o.id == "good":
                tokens += o.token_ids
    assert tokens == reference[("all", 0)]
    assert set(errors) == set(bad)
    assert "no adapter directory" in errors["missing"] and "DoRA" in errors["dora"]
    assert "MAX_LORA_RANK 32" in errors["rank"] and "holds no LoRA weights" in errors["shape"]


def test_the_checks_read_only_the_files(tiny_model_dir: str, adapters: dict[str, str]) -> None:
    dims = Dims.of(tiny_model_dir)
    info = check_adapter(adapters["attn"], dims, 64)
    assert info.max_rank == 16 and info.scaling[(0, "q_proj")] == pytest.approx(8 / 4)  # rsLoRA: alpha / sqrt(r)
    assert check_adapter(adapters["mlp"], dims, 64).scaling[(1, "up_proj")] == 1.0  # alpha_pattern: 64 / 64
    wrong = Dims(dims.layers, {**dims.shapes, "q_proj": (128, 64)})
    with pytest.raises(AdapterError, match=r"layer 0 q_proj: .* do not fit the base model's \[128, 64\]"):
        check_adapter(adapters["all"], wrong, 64)


def test_lora_modules_take_vllms_forms() -> None:
    assert [(m.name, m.path, m.base_model_name) for m in parse_modules("a=/x/a b=/x/b", "base")] == [
        ("a", "/x/a", "base"), ("b", "/x/b", "base")]
    json_form = '{"name": "a", "path": "/x/a", "base_model_name": "m"} {"name": "b", "path": "/x/b"}'
    assert [(m.name, m.base_model_name) for m in parse_modules(json_form, "base")] == [("a", "m"), ("b", "base")]
    assert [m.name for m in parse_modules('[{"name": "a", "path": "/p"}]', "base")] == ["a"]
    for bad in ("a", "a=/x a=/y", '{"name": 1}', "=x"):
        with pytest.raises(ValueError, match="LORA_MODULES|adapter name"):
            parse_modules(bad, "base")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_adapter_rows_update_has_the_same_bits_whatever_its_slot_and_the_rows_beside_it(
        tiny_model_dir: str, adapters: dict[str, str], dtype: torch.dtype) -> None:
    """A row's update reads only its own slot of the stacks: the same bits at every row count, beside rows of other
    adapters and of none, in any slot."""
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU has no bfloat16 instructions")
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype=str(dtype).split(".")[1], max_num_seqs=4,
                                    max_loras=4, max_lora_rank=64))
    loras = engine.loras
    torch.manual_seed(0)
    x, y0 = torch.randn(40, 128, dtype=dtype), torch.randn(40, 64, dtype=dtype)
    want = None
    for slot in (0, 3):
        for name in list(loras.resident):
            loras._evict(name)
        if slot:  # the others first, so that "all" lands in the last slot
            for other in ("attn", "mlp", "spare"):
                loras.release(loras.acquire(other, adapters.get(other, adapters["attn"])))  # type: ignore[arg-type]
        adapter = loras.acquire("all", adapters["all"])
        assert adapter is not None and adapter.slot == slot
        others = [a for a in loras.resident.values() if a is not adapter]
        for rows in (1, 2, 3, 8, 17, 40):
            beside = [others[k % len(others)] if others and k % 3 else None for k in range(rows - 1)]
            batch = loras.batch([adapter, *beside])
            assert batch is not None
            y = batch.apply(0, "down", x[:rows], y0[:rows])
            want = y[0].clone() if want is None else want
            assert torch.equal(y[0], want), (slot, rows)
            if rows > 1:
                assert beside[0] is None and torch.equal(y[1], y0[1])  # a row without an adapter: unchanged
        loras.release(adapter)


def test_a_request_does_not_wait_for_another_adapters_prefill_of_its_prompt(tiny_model_dir: str,
                                                                           adapters: dict[str, str]) -> None:
    """A request waits a step for a running prefill of its own prompt only when it could take those blocks from the
    prefix cache: never beside the same prompt under another adapter (their K/V differ)."""
    prompt = [100 + (i * 31) % 800 for i in range(200)]
    for first_under, waits in ((None, True), ("all", False)):
        engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", max_num_seqs=4,
                                        max_num_batched_tokens=32, max_lora_rank=64))
        engine.add_request(on(first_under, adapters, "first", prompt, 2, priority=10))
        engine.step()  # its first chunk of 32
        engine.add_request(on(None, adapters, "base", prompt, 2))
        engine.step()
        assert (engine.seqs["base"].num_computed == 0) is waits, first_under
