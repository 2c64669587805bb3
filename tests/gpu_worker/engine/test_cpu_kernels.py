"""The compiled CPU kernels (cpu_kernels.py): decode attention read in place attends each row to its own blocks up to
its own length as SDPA does over the same tokens gathered, for every head shape it takes, both dtypes, any block
size; prefill attention read in place attends every chunk's queries causally over its cached tokens and its own as
SDPA does (float32 with AVX512 or AVX2, bfloat16 with AVX512-BF16; on a CPU with AVX512 the AVX2-only CPUs' build
too); the fused layer steps compute what torch's ops compute; and the
engine gives token for token what it gives on torch's ops alone (CPU_KERNELS=false, also what runs where no compiler
is)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_worker.engine import EngineConfig, LLMEngine
from gpu_worker.engine import cpu_kernels as pa
from gpu_worker.engine.block_manager import BlockManager
from shared.schemas import Request
from tests.gpu_worker.engine.test_engine import prompt_ids, run


@pytest.fixture(scope="module")
def kernel() -> pa.PagedDecode:
    k = pa.load_paged_decode()
    assert k is not None, "the kernel did not build (g++ is part of the test machine)"
    return k


@pytest.fixture(scope="module")
def ops() -> pa.LayerOps:
    o = pa.load_layer_ops()
    assert o is not None, "the layer ops did not build (g++ is part of the test machine)"
    return o


@pytest.fixture(scope="module", params=["native", "avx2"])
def prefill(request: pytest.FixtureRequest) -> pa.PagedPrefill | None:
    """The paged prefill kernel as this CPU builds it (None without AVX512 or AVX2), and as an AVX2-only CPU does
    (built here with AVX512 off)."""
    if request.param == "native":
        return pa.load_paged_prefill()
    avx2 = pa.build_paged_prefill_avx2()
    if avx2 is None:
        pytest.skip("the AVX2 build is this CPU's own (or it has no AVX2)")
    assert avx2.lanes == 8 and avx2.dtypes == {torch.float32}
    return avx2


def _reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
               bs: int) -> torch.Tensor:
    out = []
    for r in range(q.shape[0]):
        slots = (tables[r].long()[:, None] * bs + torch.arange(bs)).reshape(-1)[: int(lens[r])]
        k, v = kc[:, slots].float()[None], vc[:, slots].float()[None]
        out.append(F.scaled_dot_product_attention(q[r].float()[None, :, None], k, v, enable_gqa=True)[0, :, 0])
    return torch.stack(out)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 70), min_size=1, max_size=9), st.sampled_from([1, 4, 16]),
       st.sampled_from([(4, 2), (9, 3), (8, 8), (4, 1)]), st.sampled_from([16, 64, 128]),
       st.sampled_from([torch.float32, torch.bfloat16]), st.integers(0, 2**16))
def test_kernel_attends_each_row_to_its_own_tokens(kernel: pa.PagedDecode, lens: list[int], bs: int,
                                                   heads: tuple[int, int], d: int, dtype: torch.dtype,
                                                   seed: int) -> None:
    H, KV = heads
    g = torch.Generator().manual_seed(seed)
    nblk = max(-(-n // bs) for n in lens)
    num_blocks = len(lens) * nblk + 1
    kc = torch.randn(KV, num_blocks * bs, d, generator=g).to(dtype)
    vc = torch.randn(KV, num_blocks * bs, d, generator=g).to(dtype)
    blocks = (torch.randperm(num_blocks - 1, generator=g) + 1)[: len(lens) * nblk]  # scattered, block 0 unused
    tables = blocks.view(len(lens), nblk).to(torch.int32)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    q = (torch.randn(len(lens), H, d, generator=g) * 2).to(dtype)
    got = kernel(q, kc, vc, tables, lens_t, bs)
    want = _reference(q, kc, vc, tables, lens_t, bs)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's own rounding
    assert (got.float() - want).abs().max().item() < tol


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 150), st.integers(1, 140)), min_size=1, max_size=5), st.sampled_from([1, 16]),
       st.sampled_from([(4, 2), (9, 3), (8, 8), (4, 1)]), st.sampled_from([16, 64, 128]), st.data(),
       st.integers(0, 2**16))
def test_prefill_kernel_attends_each_chunk_causally_over_its_cache(prefill: pa.PagedPrefill | None,
                                                                   chunks: list[tuple[int, int]], bs: int,
                                                                   heads: tuple[int, int], d: int, data: st.DataObject,
                                                                   seed: int) -> None:
    """Chunks (tokens cached before them, their own count) of scattered block tables, every row of a chunk against
    SDPA over its sequence's tokens up to its own position, float32; q read from a wider row (as from qkv). Each
    dtype the build takes (bfloat16 needs AVX512-BF16)."""
    if prefill is None:
        pytest.skip("the paged prefill kernel needs AVX512 or AVX2 + FMA")
    dtype = data.draw(st.sampled_from(sorted(prefill.dtypes, key=str)))
    H, KV = heads
    g = torch.Generator().manual_seed(seed)
    nblks = [-(-(p + n) // bs) for p, n in chunks]
    num_blocks = sum(nblks) + 1
    kc = torch.randn(KV, num_blocks * bs, d, generator=g).to(dtype)
    vc = torch.randn(KV, num_blocks * bs, d, generator=g).to(dtype)
    blocks = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # scattered, block 0 unused
    tables = [blocks[sum(nblks[:i]) : sum(nblks[: i + 1])] for i in range(len(chunks))]
    rows = sum(n for _, n in chunks)
    qkv = (torch.randn(rows, H + 2 * KV, d, generator=g) * 2).to(dtype)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    starts, lengths = i32([p for p, _ in chunks]), i32([n for _, n in chunks])
    spec = pa.PrefillChunks(i32([t + [0] * (max(nblks) - len(t)) for t in tables]), starts, lengths,
                            i32([sum(n for _, n in chunks[:i]) for i in range(len(chunks))]),
                            torch.empty(prefill.workspace(starts, lengths, KV, d, dtype), dtype=torch.int32))
    out = prefill(qkv[:, :H], kc, vc, spec, bs, torch.empty(rows, H, d, dtype=dtype))
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's own rounding
    row = 0
    for (p, n), table in zip(chunks, tables):
        slots = (torch.tensor(table)[:, None] * bs + torch.arange(bs)).reshape(-1)[: p + n]
        k, v = kc[:, slots].float()[None], vc[:, slots].float()[None]
        q = qkv[row : row + n, :H].float().transpose(0, 1)[None]
        mask = torch.arange(p + n)[None, :] <= torch.arange(p, p + n)[:, None]
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)
        assert (out[row : row + n].float() - want).abs().max().item() < tol, (p, n)
        row += n


def test_shapes_without_a_kernel_are_refused(kernel: pa.PagedDecode) -> None:
    assert not pa.supports_paged_decode(torch.device("cpu"), torch.float32, 4, 2, 48)
    assert not pa.supports_paged_decode(torch.device("cpu"), torch.float16, 4, 2, 64)
    assert not pa.supports_paged_decode(torch.device("meta"), torch.float32, 4, 2, 64)
    q, kv = torch.zeros(1, 4, 48), torch.zeros(2, 16, 48)
    with pytest.raises(ValueError, match="no paged decode kernel"):
        kernel(q, kv, kv, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 16)


def test_loading_the_kernels_leaves_subnormals_alone(kernel: pa.PagedDecode, ops: pa.LayerOps) -> None:
    """Built with -ffast-math but not linked with it: loading them must not turn on flush-to-zero process-wide."""
    tiny = float("5e-324")
    assert tiny * 1.0 != 0.0
    assert torch.tensor([1e-40]).mul(1.0).item() != 0.0


def test_no_compiler_means_torch_ops_and_a_built_kernel_needs_none(tmp_path: Path) -> None:
    # compiler and cache given, not set in the environment: a stack another test starts from this process
    # would inherit them
    no_compiler = {"compiler": "no-such-c++-compiler", "cache": tmp_path}  # nothing built here yet
    with pytest.raises(FileNotFoundError):
        pa.build("layer_ops", **no_compiler)
    assert pa._load(pa.LayerOps, "layer_ops", "torch's ops", **no_compiler) is None  # the model then keeps torch's path
    built = pa.build("layer_ops", compiler="g++", cache=tmp_path)
    # a worker without a compiler, sharing the cache
    assert pa.build("layer_ops", **no_compiler) == built
    assert pa._load(pa.LayerOps, "layer_ops", "torch's ops", **no_compiler) is not None


def test_workers_starting_together_build_a_kernel_once(tmp_path: Path) -> None:
    """Three builders at once on an empty cache (workers starting together on a fresh host): the compiler runs once
    (a compile and a link), and all three get the one library."""
    log = tmp_path / "cxx.log"
    cxx = tmp_path / "logging-g++"
    cxx.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexec g++ "$@"\n')
    cxx.chmod(0o755)
    with ThreadPoolExecutor(3) as pool:
        built = list(pool.map(lambda _: pa.build("layer_ops", compiler=str(cxx), cache=tmp_path / "kernels"), range(3)))
    assert len(set(built)) == 1 and built[0].exists()
    assert len(log.read_text().splitlines()) == 2  # one compile, one link


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 300])
def test_fused_layer_steps_compute_what_torch_does(ops: pa.LayerOps, dtype: torch.dtype, n: int) -> None:
    """RMSNorm, SiLU(gate) * up, and RoPE with the cache write, at decode and prefill row counts (300 rows: threads)."""
    g = torch.Generator().manual_seed(n)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    x, w = (torch.randn(n, 576, generator=g) * 3).to(dtype), torch.randn(576, generator=g).to(dtype)
    want = (F.rms_norm(x.float(), (576,), eps=1e-5).to(dtype) * w) if dtype == torch.bfloat16 else F.rms_norm(
        x, (576,), w, 1e-5)
    assert (ops.rms_norm(x, w, 1e-5).float() - want.float()).abs().max().item() <= tol * want.abs().max().item()
    gu = (torch.randn(n, 2 * 96, generator=g) * 4).to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    want = F.silu(gate) * up
    assert (ops.silu_mul(gu).float() - want.float()).abs().max().item() <= tol * want.abs().max().item() + 1e-6
    H, KV, D, slots = 9, 3, 64, 512
    qkv = torch.randn(n, H + 2 * KV, D, generator=g).to(dtype)
    cos, sin = torch.randn(400, D, generator=g).to(dtype), torch.randn(400, D, generator=g).to(dtype)
    pos = torch.randint(0, 400, (n,), generator=g)
    where = torch.randperm(slots, generator=g)[:n]
    kc, vc = torch.zeros(KV, slots, D, dtype=dtype), torch.zeros(KV, slots, D, dtype=dtype)
    qk = qkv[:, : H + KV]
    want_qk = torch.addcmul(qk * cos[pos][:, None], qk.roll(D // 2, dims=-1), sin[pos][:, None])
    want_v = qkv[:, H + KV :].clone()
    ops.rope_and_cache(qkv, cos, sin, pos, where, kc, vc, H)
    assert (qkv[:, : H + KV].float() - want_qk.float()).abs().max().item() <= tol * want_qk.abs().max().item()
    assert torch.equal(kc[:, where].transpose(0, 1), qkv[:, H : H + KV]) and torch.equal(vc[:, where].transpose(0, 1),
                                                                                        want_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_softmax_of_a_prefill_block_is_torch_softmax_over_what_each_row_sees(ops: pa.LayerOps,
                                                                                    dtype: torch.dtype) -> None:
    """A block of query rows 8..19 of three chunks starting at positions 0, 5 and 30 (KV 2, G 3), 60 keys: row i of
    chunk b sees keys 0 .. starts[b] + 8 + i; the rest get 0."""
    g = torch.Generator().manual_seed(3)
    starts, row0, rows, kv, grp, keys = [0, 5, 30], 8, 12, 2, 3, 60
    scores = (torch.randn(len(starts) * kv, grp * rows, keys, generator=g) * 4).to(dtype)
    pos = torch.tensor(starts)[:, None, None, None] + row0 + torch.arange(rows)[None, None, None, :]  # [B,1,1,rows]
    seen = torch.arange(keys)[None, None, None, None, :] <= pos[..., None]  # [B, 1, 1, rows, keys]
    mask = seen.expand(len(starts), kv, grp, rows, keys).reshape(len(starts) * kv, grp * rows, keys)
    want = torch.softmax(scores.float().masked_fill(~mask, float("-inf")), dim=-1)
    got = ops.causal_softmax_(scores.clone(), torch.tensor(starts), row0, kv, grp)
    assert (got.float() - want).abs().max().item() < (1e-6 if dtype == torch.float32 else 4e-3)
    assert not got.float()[~mask].any()


def test_kernels_give_the_same_bits_on_two_threads(kernel: pa.PagedDecode, ops: pa.LayerOps,
                                                   prefill: pa.PagedPrefill | None) -> None:
    """Each row (decode), query tile (prefill) or row of scores is one thread's: the split across threads changes no
    bit, two threads against one."""
    g = torch.Generator().manual_seed(5)
    H, KV, D, bs = 9, 3, 64, 16
    kc, vc = torch.randn(KV, 64 * bs, D, generator=g).bfloat16(), torch.randn(KV, 64 * bs, D, generator=g).bfloat16()
    tables = (torch.randperm(63, generator=g) + 1).view(3, 21).to(torch.int32)
    lens = torch.tensor([300, 17, 250], dtype=torch.int32)
    q = torch.randn(3, H, D, generator=g).bfloat16()
    scores = torch.randn(3 * KV, 3 * 64, 300, generator=g)
    starts = torch.tensor([0, 40, 200])
    qkv = torch.randn(330, H + 2 * KV, D, generator=g)

    def compute() -> list[torch.Tensor]:
        out = [kernel(q, kc, vc, tables, lens, bs), ops.causal_softmax_(scores.clone(), starts, 8, KV, 3),
               ops.rms_norm(scores.view(-1, 600), torch.ones(600), 1e-5)]
        i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
        st, ln = i32([0, 200]), i32([300, 30])  # chunks of 300 (from token 0) and 30 (after 200 cached)
        for dt in prefill.dtypes if prefill is not None else ():
            spec = pa.PrefillChunks(tables[[0, 2]], st, ln, i32([0, 300]),
                                    torch.empty(prefill.workspace(st, ln, KV, D, dt), dtype=torch.int32))
            out.append(prefill(qkv[:, :H].to(dt), kc.to(dt), vc.to(dt), spec, bs, torch.empty(330, H, D, dtype=dt)))
        return out

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = compute()
        torch.set_num_threads(1)
        one = compute()
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(two, one))


def test_engine_tokens_equal_torch_ops_alone(tiny_model_dir: str) -> None:
    """Staggered greedy requests (rows of many lengths, block boundaries crossed, preemption in a small pool) give
    token for token what torch's ops alone give (K/V gathered for SDPA, per-chunk SDPA, unfused steps). Greedy only:
    the kernels sum in another order (last-bit differences in float32), which can flip a seeded draw at a near tie
    (one did, at token 31 of 48, once float32 prefill read the cache in place)."""
    prompts = [prompt_ids(tiny_model_dir, "Tell me about " + "the sea and its tides " * (1 + i % 5)) for i in range(10)]
    reqs = [Request(f"r{i}", p, max_tokens=24 + 3 * i, ignore_eos=True, temperature=0.0) for i, p in enumerate(prompts)]
    arrivals = {f"r{i}": i for i in range(10)}
    got = {}
    for paged in (True, False):
        eng = LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", max_num_seqs=8, cpu_kernels=paged))
        eng.blocks = eng.scheduler.blocks = BlockManager(12, eng.runner.block_size)  # ~ 2 sequences' worth
        assert (eng.runner.model.paged_decode is not None) == paged and (eng.runner.model.ops is not None) == paged
        assert eng.batch_invariant == paged  # torch's attention paths switch by batch size: a seed's text can change
        got[paged] = run(eng, reqs, arrivals)
        assert eng.scheduler.num_preemptions > 0
    assert got[True] == got[False]
