"""Prefill chunks of one step attended at once, as one padded batch (`Llama._prefill_batch`) or in place over the
paged cache (the bfloat16 kernel, `Llama.paged_prefill`): first chunks of different lengths, chunks that follow
cached tokens and decode rows, side by side in one step, give every row the logits the model's own forward gives at
that position."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.engine import EngineConfig, LLMEngine, StepBatch
from gpu_worker.engine.cpu_kernels import load_paged_prefill
from gpu_worker.engine.models import llama
from gpu_worker.engine.sequence import Sequence
from shared.schemas import Request
from tests.gpu_worker.engine.test_engine import _tiny


def _all_logits(eng: LLMEngine, batch: StepBatch) -> torch.Tensor:
    """Every row's logits (decode rows, then each chunk's tokens), float32."""
    runner = eng.runner
    with torch.inference_mode():
        inputs = runner.prepare(batch)
        h = runner.model.forward(inputs.ids, inputs.positions, inputs.attn, runner.cache)
        return runner.model.compute_logits(h).float()


@pytest.mark.parametrize(("path", "block_rows"), [("batched", 4), ("batched", 64), ("paged", 0)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_batched_prefill_of_mixed_chunks_matches_transformers(arch: str, dtype: str, path: str, block_rows: int,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = load_paged_prefill()
    if path == "paged" and (kernel is None or getattr(torch, dtype) not in kernel.dtypes):
        pytest.skip("the paged prefill kernel needs AVX512 (AVX512-BF16 for bfloat16)")
    monkeypatch.setattr(llama, "PREFILL_BLOCK_ROWS", block_rows or llama.PREFILL_BLOCK_ROWS)
    model = _tiny(arch).to(getattr(torch, dtype))
    lengths = {"a": 6, "b": 23, "c": 40, "d": 17, "e": 9}
    prompts = {k: [(11 * i + 5 * j) % 500 + 3 for j in range(n)] for i, (k, n) in enumerate(lengths.items())}
    with torch.inference_mode():  # reference first: the runner takes the model over
        refs = {k: model(torch.tensor([ids])).logits[0].float() for k, ids in prompts.items()}
    eng = LLMEngine(EngineConfig(model="unused", dtype=dtype, prefix_caching=False), model=model)
    eng.runner.model.batch_prefill = True  # the batched path in float32 too: there it must be as exact as SDPA
    if path == "batched":
        eng.runner.model.paged_prefill = None
    assert (eng.runner.model.paged_prefill is not None) == (path == "paged")
    seqs = {}
    for k, ids in prompts.items():
        seqs[k] = Sequence(Request(k, ids if k != "a" else ids[:-1]))
        assert eng.blocks.allocate(seqs[k])
    tol = 1e-4 if dtype == "float32" else 0.03

    def check(batch: StepBatch) -> None:
        logits, row = _all_logits(eng, batch), 0
        expect = [(s, s.num_computed, 1) for s in batch.decode] + [(s, s.num_computed, n) for s, n in batch.chunks]
        for s, p, n in expect:
            ref = refs[s.id][p : p + n]
            got = logits[row : row + n]
            assert (got - ref).abs().max().item() < tol * ref.abs().max().item(), (s.id, p, n)
            if dtype == "float32":
                assert torch.equal(got.argmax(-1), ref.argmax(-1)), (s.id, p, n)
            row += n
        for s in batch.decode:
            s.num_computed += 1
        for s, n in batch.chunks:
            s.num_computed += n

    # first chunks only: whole prompts and the first parts of others, all of different lengths
    check(StepBatch(decode=[], chunks=[(seqs["a"], 5), (seqs["b"], 10), (seqs["c"], 40), (seqs["d"], 9)]))
    # a decode row, chunks after cached tokens (across a block boundary) and a first chunk, in one step
    seqs["a"].token_ids.append(prompts["a"][-1])
    eng.blocks.append(seqs["a"])
    check(StepBatch(decode=[seqs["a"]], chunks=[(seqs["b"], 13), (seqs["d"], 8), (seqs["e"], 9)]))
