"""Batch invariance, kernel by kernel: a row's output bits are the same alone as among 1, 7, 31 and 63 others (and a
prefill step's worth), wherever it sits among them, in each dtype the build takes: the linear layers (the packed
GEMM, oneDNN, and oneDNN held to AVX2 as an AVX2-only CPU runs it), RMSNorm, SiLU * up and RoPE, decode attention
read in place (the other rows longer or shorter), prefill attention read in place (among other chunks, and the same
prompt cut into other chunks), and the sampler (greedy, temperature, top-k, top-p at ties). The compiled kernels as
this CPU builds them and, on a CPU with AVX512, as an AVX2-only CPU does."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch

from gpu_worker.engine import cpu_kernels as ck
from gpu_worker.engine.device import cpu_has_bf16
from gpu_worker.engine.gemm import OneDnnGemm, choose_gemm
from gpu_worker.engine.sampler import Sampler, token_logprobs
from gpu_worker.engine.sequence import Sequence
from shared.schemas import Request

OTHERS = (1, 7, 31, 63)
DTYPES = [torch.float32, *([torch.bfloat16] if cpu_has_bf16() else [])]
# (out, in) of the default model's matrices (fused qkv, o, fused gate/up, down, LM head), and a wider model's
GEMM_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (2048, 2048)]


def _among(row: torch.Tensor, others: torch.Tensor, at: int) -> torch.Tensor:
    """`others` with `row` inserted before index `at`."""
    return torch.cat((others[:at], row, others[at:]))


def _places(n: int) -> list[int]:
    return sorted({0, n // 2, n})


def gemm_rows_that_differ(dtype: torch.dtype, packed: bool = False) -> list[str]:
    """Each (shape, op, batch, place) where a row differs from the same row alone; [] when none does. Eight rows each
    alone, and each among the others at a place of its own (a bfloat16 output rounds away most differences in the
    sums: one row in ten shows one). oneDNN, or with `packed` the packed GEMM where the CPU has it."""
    gemm, _ = choose_gemm(torch.device("cpu"), dtype, packed=packed)
    g = torch.Generator().manual_seed(0)
    bad = []
    for n, k in GEMM_SHAPES:
        w = gemm.prepare((torch.randn(n, k, generator=g) * k**-0.5).to(dtype))
        sizes = (*OTHERS, 300) if n * k < 2**24 else OTHERS  # 300: a prefill step's rows (not for an LM head)
        x = torch.randn(8 + max(sizes), k, generator=g).to(dtype)
        res = torch.randn(8 + max(sizes), n, generator=g).to(dtype)
        with torch.inference_mode():
            for r in range(8):
                alone, alone_add = gemm.linear(x[r : r + 1], w), gemm.linear_add(x[r : r + 1], w, res[r : r + 1])
                for m in sizes:
                    at = _places(m)[r % 3 % len(_places(m))]
                    out = gemm.linear(_among(x[r : r + 1], x[8 : 8 + m], at), w)
                    added = gemm.linear_add(_among(x[r : r + 1], x[8 : 8 + m], at), w,
                                            _among(res[r : r + 1], res[8 : 8 + m], at))
                    bad += [f"{n}x{k} {op} row {r} among {m} at {at}" for op, got, want in (
                        ("linear", out, alone), ("linear_add", added, alone_add)) if not torch.equal(got[at], want[0])]
    return bad


@pytest.mark.parametrize("packed", [False, True], ids=["onednn", "packed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_layers_give_a_row_the_same_bits_whatever_the_batch(dtype: torch.dtype, packed: bool) -> None:
    if packed and not ck.supports_packed_gemm(torch.device("cpu"), dtype):
        pytest.skip("this CPU has not the packed GEMM's instructions for this dtype")
    assert gemm_rows_that_differ(dtype, packed) == []


def test_a_batch_split_into_calls_of_a_few_rows_gives_each_row_its_own_output() -> None:
    """With AMX a batch goes in calls of at most 32 rows (gemm.AMX_MAX_ROWS); here 7, in float32 (a row's bits there
    whatever the batch): each row's output, and its residual's sum, is the one it gets in one call."""
    g = torch.Generator().manual_seed(3)
    whole, split = OneDnnGemm(32), OneDnnGemm(32, max_rows=7)
    w = whole.prepare(torch.randn(96, 64, generator=g))
    x, res, b = torch.randn(30, 64, generator=g), torch.randn(30, 96, generator=g), torch.randn(96, generator=g)
    with torch.inference_mode():
        assert torch.equal(split.linear(x, w, b), whole.linear(x, w, b))
        assert torch.equal(split.linear_add(x, w, res), whole.linear_add(x, w, res))
        assert split.linear(x[:7], w).shape == (7, 96)


def test_linear_layers_held_to_avx2_give_a_row_the_same_bits_whatever_the_batch() -> None:
    """float32 as an AVX2-only CPU runs it: oneDNN held to AVX2 (ONEDNN_MAX_CPU_ISA, read once per process)."""
    code = ("import torch; from tests.gpu_worker.engine.test_batch_invariance import gemm_rows_that_differ as f; "
            "print(f(torch.float32))")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ONEDNN_VERBOSE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         check=True).stdout
    assert "brg_matmul:avx2" in out or "gemm:jit" in out  # the ISA was held
    assert out.strip().splitlines()[-1] == "[]"


def _avx2_too() -> bool:
    """Whether this CPU also runs the build an AVX2-only CPU gets (it has AVX512, and AVX2 + FMA)."""
    flags = ck._cpu_flags().split()
    return all(f in flags for f in (b"avx512f", b"avx2", b"fma"))


K = TypeVar("K")


def _kernel(build: str, param: str, wrap: Callable[[Any], K], load: Callable[[], K | None]) -> K:
    """A kernel as this CPU builds it ("native"), or as an AVX2-only CPU does ("avx2")."""
    if param == "avx2":
        if not _avx2_too():
            pytest.skip("this CPU's build is the AVX2 one (or it has no AVX2)")
        return wrap(ck.build(build, extra=ck.AVX2_ONLY))
    kernel = load()
    assert kernel is not None, f"{build} did not build (g++ is part of the test machine)"
    return kernel


@pytest.fixture(scope="module", params=["native", "avx2"])
def ops(request: pytest.FixtureRequest) -> ck.LayerOps:
    """The layer ops as this CPU builds them, and as an AVX2-only CPU does."""
    return _kernel("layer_ops", request.param, ck.LayerOps, ck.load_layer_ops)


@pytest.fixture(scope="module", params=["native", "avx2"])
def decode(request: pytest.FixtureRequest) -> ck.PagedDecode:
    """The decode attention kernel as this CPU builds it, and as an AVX2-only CPU does."""
    return _kernel("paged_attention", request.param, ck.PagedDecode, ck.load_paged_decode)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [576, 1000])  # the default model's hidden size, and rows not 64-byte aligned
def test_layer_ops_give_a_row_the_same_bits_whatever_the_batch(ops: ck.LayerOps, dtype: torch.dtype,
                                                               width: int) -> None:
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(64, width, generator=g) * 3).to(dtype)
    w = torch.randn(width, generator=g).to(dtype)
    H, KV, D = 9, 3, 64
    qkv = torch.randn(64, H + 2 * KV, D, generator=g).to(dtype)
    cos, sin = torch.randn(256, D, generator=g).to(dtype), torch.randn(256, D, generator=g).to(dtype)
    pos = torch.randint(0, 256, (64,), generator=g)

    def rope(rows: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kc, vc = torch.zeros(KV, 64, D, dtype=dtype), torch.zeros(KV, 64, D, dtype=dtype)
        out = rows.clone()
        ops.rope_and_cache(out, cos, sin, p, torch.arange(rows.shape[0]), kc, vc, H)
        return out, kc[:, : rows.shape[0]].transpose(0, 1)

    alone = ops.rms_norm(x[:1].clone(), w, 1e-5), ops.silu_mul(x[:1].clone()), rope(qkv[:1], pos[:1])
    for m in OTHERS:
        for at in _places(m):
            batch = _among(x[:1], x[1 : 1 + m], at)
            assert torch.equal(ops.rms_norm(batch, w, 1e-5)[at], alone[0][0]), (m, at)
            assert torch.equal(ops.silu_mul(batch)[at], alone[1][0]), (m, at)
            q, k = rope(_among(qkv[:1], qkv[1 : 1 + m], at), _among(pos[:1], pos[1 : 1 + m], at))
            assert torch.equal(q[at], alone[2][0][0]) and torch.equal(k[at], alone[2][1][0]), (m, at)


def _cache(g: torch.Generator, kv: int, blocks: int, bs: int, d: int,
           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(torch.randn(kv, blocks * bs, d, generator=g).to(dtype) for _ in range(2))  # type: ignore[return-value]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_gives_a_row_the_same_bits_whatever_the_batch(decode: ck.PagedDecode,
                                                                       dtype: torch.dtype) -> None:
    """A row reading 100 tokens, alone and among rows of 1-400 tokens (the longest sets the padded tables and the
    kernel's score stride)."""
    kernel = decode
    H, KV, D, bs, most = 9, 3, 64, 16, 25
    g = torch.Generator().manual_seed(2)
    kc, vc = _cache(g, KV, 64 * most + 1, bs, D, dtype)
    tables = (torch.randperm(64 * most, generator=g) + 1).view(64, most).to(torch.int32)
    lens = torch.randint(1, most * bs + 1, (64,), generator=g).to(torch.int32)
    lens[0] = 100
    q = torch.randn(64, H, D, generator=g).to(dtype)
    alone = kernel(q[:1], kc, vc, tables[:1, : -(-100 // bs)], lens[:1], bs)
    for m in OTHERS:
        for at in _places(m):
            rows = _among(torch.tensor([0]), torch.arange(1, 1 + m), at)
            out = kernel(q[rows], kc, vc, tables[rows], lens[rows], bs)
            assert torch.equal(out[at], alone[0]), (m, at)


def _prefill_builds() -> list[ck.PagedPrefill]:
    builds = [b for b in (ck.load_paged_prefill(), ck.build_paged_prefill_avx2()) if b is not None]
    if not builds:
        pytest.skip("the paged prefill kernel needs AVX512 or AVX2 + FMA")
    return builds


def _prefill(kernel: ck.PagedPrefill, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, tables: torch.Tensor,
             chunks: list[tuple[int, int]], bs: int) -> torch.Tensor:
    """The kernel over chunks (first position, tokens) of the sequences whose block tables are `tables`, q their
    rows in order."""
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    starts, lengths = i32([p for p, _ in chunks]), i32([n for _, n in chunks])
    offsets = i32([sum(n for _, n in chunks[:i]) for i in range(len(chunks))])
    work = torch.empty(kernel.workspace(starts, lengths, kc.shape[0], kc.shape[2], q.dtype), dtype=torch.int32)
    return kernel(q, kc, vc, ck.PrefillChunks(tables, starts, lengths, offsets, work), bs,
                  torch.empty(q.shape, dtype=q.dtype))


def test_prefill_attention_gives_a_chunk_the_same_bits_whatever_the_batch_and_the_cuts() -> None:
    """A chunk of 40 tokens after 70 cached, alone and among 1-63 chunks of other sequences (0-200 cached, 1-90
    tokens); and a 300-token prompt in one chunk against the same prompt cut in three (each cut after the ones
    before are cached), in each build and dtype."""
    H, KV, D, bs, nblk = 9, 3, 64, 16, 19
    for kernel in _prefill_builds():
        for dtype in sorted(kernel.dtypes & set(DTYPES), key=str):
            g = torch.Generator().manual_seed(3)
            kc, vc = _cache(g, KV, 64 * nblk + 1, bs, D, dtype)
            tables = (torch.randperm(64 * nblk, generator=g) + 1).view(64, nblk).to(torch.int32)
            chunks = [(70, 40)] + [(int(torch.randint(0, 200, (1,), generator=g)),
                                    int(torch.randint(1, 90, (1,), generator=g))) for _ in range(63)]
            q = torch.randn(sum(n for _, n in chunks), H, D, generator=g).to(dtype)
            alone = _prefill(kernel, q[:40], kc, vc, tables[:1], chunks[:1], bs)
            first = [0, *torch.tensor([n for _, n in chunks]).cumsum(0).tolist()]
            for m in OTHERS:
                for at in _places(m):
                    order = _among(torch.tensor([0]), torch.arange(1, 1 + m), at).tolist()
                    rows = torch.cat([torch.arange(first[i], first[i + 1]) for i in order])
                    out = _prefill(kernel, q[rows], kc, vc, tables[order], [chunks[i] for i in order], bs)
                    start = sum(chunks[i][1] for i in order[:at])
                    assert torch.equal(out[start : start + 40], alone), (kernel.lanes, dtype, m, at)
            whole = _prefill(kernel, q[:300], kc, vc, tables[:1], [(0, 300)], bs)
            cut = torch.cat([_prefill(kernel, q[p : p + n], kc, vc, tables[:1], [(p, n)], bs)
                             for p, n in ((0, 37), (37, 163), (200, 100))])
            assert torch.equal(whole, cut), (kernel.lanes, dtype)


def _seqs(n: int, **sampling: object) -> list[Sequence]:
    return [Sequence(Request(f"r{i}", [1, 2, 3], seed=100 + i, **sampling)) for i in range(n)]  # type: ignore[arg-type]


def _tied_logits(g: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    """bfloat16 logits, as the model gives them (many equal values); row 0 one likely token then 600 tied ones, where
    a top-p of 0.9 cuts; row 1 flat (its nucleus is most of the vocabulary)."""
    x = (torch.randn(rows, vocab, generator=g) * 2).bfloat16()
    x[0] = -20.0
    x[0, 7] = 8.0
    x[0, torch.randperm(vocab, generator=g)[:600]] = 8.0 - 6.396
    x[1] = (torch.randn(vocab, generator=g) * 0.01).bfloat16()
    return x


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.7, top_k=50),
                                      dict(temperature=1.0, top_p=0.9), dict(temperature=0.8, top_p=0.5, top_k=900),
                                      dict(temperature=1.0, min_p=0.05)],
                         ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_sampler_gives_a_row_the_same_token_whatever_the_batch(sampling: dict) -> None:
    """Each of 64 rows' tokens over 8 draws, alone and in batches of 2-64 rows (every row of a batch asks the same,
    and a batch's other rows may be greedy or plain temperature)."""
    g = torch.Generator().manual_seed(4)
    logits = _tied_logits(g, 64, 49152)
    sampler = Sampler((2,))
    seqs = _seqs(64, **sampling)
    plain = _seqs(64, temperature=0.8)
    for _ in range(8):
        alone = [sampler(logits[i : i + 1], seqs[i : i + 1])[0][0] for i in range(64)]
        for m in (2, 8, 32, 64):
            assert sampler(logits[:m], seqs[:m])[0] == alone[:m], m
            mixed = [s if i % 3 else p for i, (s, p) in enumerate(zip(seqs[:m], plain[:m]))]
            got = sampler(logits[:m], mixed)[0]
            assert [t for i, t in enumerate(got) if i % 3] == [t for i, t in enumerate(alone[:m]) if i % 3], m
        for s in (*seqs, *plain):
            s.token_ids.append(5)


def test_top_logprobs_give_a_row_the_same_alternatives_whatever_the_batch() -> None:
    """A row's top alternatives (its tokens and their order) alone and beside rows asking for more or fewer, among
    bfloat16 logits' many equal values: equal logprobs are listed by token id, and a tie at a row's cut keeps the
    lowest ids. Before, one torch.topk took the step's largest count for every row, and which of a tie it listed,
    and in what order, followed that count (in bfloat16 a job's top_logprobs changed whenever a neighbour asked for
    more)."""
    g = torch.Generator().manual_seed(5)
    logits = _tied_logits(g, 64, 49152)
    logits[2] = -20.0
    logits[2, torch.randperm(49152, generator=g)[:40]] = 3.0  # 40 tied for first: any count cuts inside the tie
    for n in (1, 2, 5, 20):
        alone = [token_logprobs(logits[i : i + 1], [0], [n])[0] for i in range(64)]
        for i, lp in enumerate(alone):
            ids, values = lp.top_ids[0], lp.top_lps[0]
            assert len(ids) == n and sorted(zip([-v for v in values], ids)) == list(zip([-v for v in values], ids))
            if i == 2:  # the lowest ids of the tie
                assert ids == sorted(torch.nonzero(logits[2] == 3.0).squeeze(1).tolist())[:n]
        for others in (1, 5, 20):
            for m in (2, 8, 64):
                got = token_logprobs(logits[:m], [0] * m, [n if i % 2 == 0 else others for i in range(m)])
                assert [got[i] for i in range(0, m, 2)] == alone[:m:2], (n, others, m)
