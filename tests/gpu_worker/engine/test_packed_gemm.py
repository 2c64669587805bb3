"""The packed GEMM (csrc/packed_gemm.cpp, gemm.PackedGemm): x @ w.T (+ bias, + residual) at every row count and
width, on strided rows, from several threads at once; and the other kernels' loops on its pool give the bits they
give on OpenMP's team. (A row's bits whatever its batch: test_batch_invariance.py.)"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from gpu_worker.engine import cpu_kernels as ck
from gpu_worker.engine.gemm import PackedGemm, choose_gemm
from tests.conftest import ROOT

CPU = torch.device("cpu")
DTYPES = [dt for dt in (torch.float32, torch.bfloat16) if ck.supports_packed_gemm(CPU, dt)]
pytestmark = pytest.mark.skipif(not DTYPES, reason="this CPU has not AVX512F")


@pytest.fixture(scope="module")
def kernel() -> ck.PackedGemmKernel:
    k = ck.load_packed_gemm()
    assert k is not None, "packed_gemm did not build (g++ is part of the test machine)"
    return k


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, res: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().T
    if b is not None:
        out += b.double()
    if res is not None:
        out += res.double()
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 960, 576), (5, 100, 64), (12, 33, 576), (13, 576, 1536),
                                           (49, 64, 32), (130, 96, 576), (0, 64, 64), (7, 40, 9)])
def test_it_computes_x_w_t_with_bias_and_residual(kernel: ck.PackedGemmKernel, dtype: torch.dtype, m: int, n: int,
                                                  k: int) -> None:
    g = torch.Generator().manual_seed(m * 7 + n)
    wide = torch.randn(m, k + 8, generator=g).to(dtype)
    x = wide[:, 3 : 3 + k]  # rows strided, as a slice of a wider tensor
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
    b, res = torch.randn(n, generator=g).to(dtype), torch.randn(m, n, generator=g).to(dtype)
    packed = kernel.pack(w)
    assert packed.shape == (n, k)
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 2e-2}
    for bias, residual in ((None, None), (b, None), (None, res), (b, res)):
        got = kernel(x, packed, bias, residual)
        assert got.dtype == dtype and got.shape == (m, n)
        torch.testing.assert_close(got.double(), _reference(x, w, bias, residual), **tol)


def test_the_engine_takes_it_where_asked_and_the_cpu_has_it() -> None:
    dtype = DTYPES[-1]
    layers, head = choose_gemm(CPU, dtype, packed=True)
    assert isinstance(layers, PackedGemm) and head is layers
    assert not isinstance(choose_gemm(CPU, dtype)[0], PackedGemm)  # CPU_GEMM=onednn
    assert not isinstance(choose_gemm(CPU, torch.float16, packed=True)[0], PackedGemm)  # a dtype it has no kernel for


@pytest.mark.parametrize(("env", "spin"), [({}, ck.DEFAULT_SPIN), ({"OMP_WAIT_POLICY": "passive"}, 0),
                                          ({"OMP_WAIT_POLICY": "active"}, 20000), ({"GOMP_SPINCOUNT": "300"}, 300),
                                          ({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "5000"}, 5000),
                                          ({"GOMP_SPINCOUNT": "infinite"}, ck.DEFAULT_SPIN)])
def test_the_pool_spins_as_openmps_settings_say(env: dict[str, str], spin: int) -> None:
    assert ck.pool_spin(env) == spin


def test_calls_from_several_threads_at_once_each_get_their_own_product(kernel: ck.PackedGemmKernel) -> None:
    """The pool runs one call at a time: a call made meanwhile (another thread's) runs on its own thread, whole."""
    dtype = DTYPES[0]
    g = torch.Generator().manual_seed(1)
    ws = [(torch.randn(512, 256, generator=g) * 0.06).to(dtype) for _ in range(4)]
    xs = [torch.randn(32, 256, generator=g).to(dtype) for _ in range(4)]
    packed = [kernel.pack(w) for w in ws]
    want = [kernel(x, p) for x, p in zip(xs, packed, strict=True)]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            got = list(pool.map(lambda i: [kernel(xs[i], packed[i]) for _ in range(20)][-1], range(4)))
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_the_kernels_loops_on_the_pool_give_the_bits_they_give_on_openmp() -> None:
    """Decode attention, RMSNorm and SiLU * up in a process of their own, before and after the packed GEMM's pool
    takes the threads (their loops then run on it): the same bits."""
    code = """
import torch
from gpu_worker.engine import cpu_kernels as ck
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
dec, ops = ck.load_paged_decode(), ck.load_layer_ops()
rows, H, KV, D, bs, slots = 24, 8, 2, 64, 16, 4096
kc, vc = torch.randn(KV, slots, D, generator=g), torch.randn(KV, slots, D, generator=g)
tables = torch.randperm(slots // bs, generator=g)[: rows * 8].view(rows, 8).int().contiguous()
lens = torch.randint(1, 8 * bs, (rows,), generator=g, dtype=torch.int32)
q = torch.randn(rows, H, D, generator=g)
x, w = torch.randn(64, 1024, generator=g), torch.randn(1024, generator=g)
gu = torch.randn(64, 2048, generator=g)
def run():
    return dec(q, kc, vc, tables, lens, bs), ops.rms_norm(x, w, 1e-6), ops.silu_mul(gu)
before = run()
ck.load_packed_gemm().own_threads()
after = run()
ck.release_threads()
again = run()
print(all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(before, after, again)))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "True"


def test_a_chunk_whose_thread_the_os_took_away_is_computed_by_the_caller_and_never_written_late() -> None:
    """A pool thread that stops mid-chunk (as when the OS lends its core to another process) does not hold the call
    up: the caller computes that chunk itself, the product has the bits it has otherwise, and the thread, back later,
    writes nothing into the output it no longer owns; the call's inputs are kept until it is done reading them."""
    code = """
import time, torch
from gpu_worker.engine import cpu_kernels as ck
torch.set_num_threads(2)
k = ck.load_packed_gemm()
k.own_threads()
g = torch.Generator().manual_seed(0)
for dt in (torch.float32, torch.bfloat16):
    w, b = k.pack(torch.randn(3000, 576, generator=g).to(dt)), torch.randn(3000, generator=g).to(dt)
    x, r = torch.randn(32, 576, generator=g).to(dt), torch.randn(32, 3000, generator=g).to(dt)
    want = k(x, w, b, r)
    before, slowest = k.stolen(), 0.0
    for _ in range(500):  # until a pool thread stops holding a chunk (it may not take one in a given call)
        k.stall_next(1_000_000_000)
        t = time.monotonic()
        y = k(x, w, b, r)
        slowest = max(slowest, time.monotonic() - t)
        assert torch.equal(y, want)
        if k.stolen() > before:
            break
    assert k.stolen() > before, "no chunk was taken over"
    assert slowest < 0.5, slowest  # no call waited for the stopped thread (1 s)
    # its inputs kept while it may still read them (beside those of an earlier call whose thread the OS did take
    # away, under load: the reference's call may have had a chunk taken over too)
    assert any(held[0] is x for held in k._held)
    kept = y.clone()
    while k._late() < k._stolen():
        time.sleep(0.01)
    assert torch.equal(y, kept)  # back, it wrote nothing
    k(x[:4], w)
    assert k._held == []  # and the inputs are let go
    k.stall_next(0)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"


def test_a_process_forked_after_the_pool_started_computes_alone() -> None:
    """The pool's threads stay in the parent: a child's call runs on its own thread, whole, rather than waiting for
    workers it does not have."""
    code = """
import os, torch
from gpu_worker.engine import cpu_kernels as ck
torch.set_num_threads(2)
k = ck.load_packed_gemm()
k.own_threads()
w, x = k.pack(torch.randn(4096, 256)), torch.randn(32, 256)
want = k(x, w)
pid = os.fork()
if pid == 0:
    os._exit(0 if torch.equal(k(x, w), want) else 3)
print(os.waitpid(pid, 0)[1])
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "0"


def test_an_engine_step_runs_torch_on_one_thread_and_leaves_its_count_as_it_was(tiny_model_dir: str) -> None:
    """On the packed GEMM, torch's own ops run on one thread during a step (no OpenMP team beside the pool), and
    torch has its thread count back after: what else the process computes (a benchmark's other contenders, a test's
    reference) is not left on one thread."""
    code = f"""
import torch
from gpu_worker.engine import EngineConfig, LLMEngine
from shared.schemas import Request
torch.set_num_threads(2)
e = LLMEngine(EngineConfig(model={tiny_model_dir!r}, dtype="float32"))
during = []
forward = e.runner.model.forward
def spy(*args, **kwargs):
    during.append(torch.get_num_threads())
    return forward(*args, **kwargs)
e.runner.model.forward = spy
e.add_request(Request("a", [5, 6, 7], max_tokens=2))
while e.has_unfinished():
    e.step()
print(set(during), torch.get_num_threads())
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "{1} 2"
