"""An inference worker with CPU_BIND_THREADS=true (gpu_worker/cpu_affinity.py) binds its compute threads one to
a core: the thread that loaded torch is pinned to the first CPU and an OpenMP thread to another, while its output
lane runs wherever the worker could before (not on the engine's first core alone). Without it, nothing is pinned."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from shared import names
from tests.conftest import ROOT, Stack
from tests.helpers import until

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding needs two CPUs to show")


def _masks(pid: int) -> list[set[int]]:
    """Each thread's CPUs."""
    return [os.sched_getaffinity(int(t.name)) for t in Path(f"/proc/{pid}/task").iterdir()]


@pytest.mark.parametrize("bind", [True, False])
def test_compute_threads_bound_on_request_and_the_output_lane_never(tiny_stack: Stack, tmp_path: Path,
                                                                   bind: bool) -> None:
    cpus = os.sched_getaffinity(0)
    with open(tmp_path / "worker.log", "ab") as log:
        worker = subprocess.Popen([sys.executable, "-m", "infra.cli", "inference"], cwd=ROOT, stdout=log,
                                  stderr=subprocess.STDOUT,
                                  env={**tiny_stack.env, "CPU_BIND_THREADS": str(bind).lower()})
    try:
        until("the worker to serve", lambda: worker.pid in tiny_stack.worker_pids(names.INFERENCE_POOL), timeout=60)
        [lane] = until("its output lane", lambda: psutil.Process(worker.pid).children()[:1] or None, timeout=30)
        if bind:
            assert os.sched_getaffinity(worker.pid) == {min(cpus)}  # the thread that loaded torch: the first core
            until("an OpenMP thread on a core of its own",
                  lambda: any(len(m) == 1 and m != {min(cpus)} for m in _masks(worker.pid)), timeout=10)
        else:
            assert all(m == cpus for m in _masks(worker.pid))
        assert os.sched_getaffinity(lane.pid) == cpus
    finally:
        worker.terminate()
        worker.wait(30)


def test_conveyor_up_binds_a_lone_inference_worker_unless_told() -> None:
    """`conveyor up` binds when its stack runs at most one inference worker (vLLM-CPU's layout), never when the
    pools may hold more (they would crowd the same cores), and an operator's CPU_BIND_THREADS wins."""
    from infra.supervisor import one_worker_binds

    assert one_worker_binds({}, 1) == {"CPU_BIND_THREADS": "true"}
    assert one_worker_binds({}, 0) == {"CPU_BIND_THREADS": "true"}  # a pool at zero starts one at most
    assert one_worker_binds({}, 2) == {}
    assert one_worker_binds({"CPU_BIND_THREADS": "false"}, 1) == {}
