"""How long a new inference worker takes before it serves (what the autoscaler waits for when it scales out):
from its process start until its heartbeat is live, and, in a fresh process of its own, where that time goes
(imports, the model's load and weight preparation) and what its first request costs against the same request
again (first-call work of the kernels, memory faulted in).

    .venv/bin/python -m bench cold-start                 # default model, float32 and bfloat16, 3 starts each
    .venv/bin/python -m bench cold-start --quick         # tiny model, one start
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import chosen_model, parser

# run in a fresh interpreter: every figure is from that process's own start
PHASES = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
from gpu_worker.engine import EngineConfig, LLMEngine
from shared.schemas import Request
t_import = time.perf_counter()
engine = LLMEngine(EngineConfig(model=sys.argv[1], dtype=sys.argv[2], max_num_seqs=8))
t_load = time.perf_counter()
def one(rid):
    engine.add_request(Request(rid, list(range(100, 140)), max_tokens=16, temperature=0.0, ignore_eos=True))
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t
first, again = one("a"), one("b")
print(json.dumps({"import": t_import - t0, "load": t_load - t_import, "first": first, "again": again}))
"""


def worker_live(model: str, dtype: str, redis_url: str, timeout: float = 300.0) -> float:
    """Seconds from starting `conveyor inference` until its heartbeat is in the registry (then stopped)."""
    import redis

    from shared import names
    from shared.signals import read_live

    client = redis.Redis.from_url(redis_url)
    env = {**os.environ, "REDIS_URL": redis_url, "MODEL": model, "DTYPE": dtype, "HEARTBEAT_S": "0.2"}
    before = set(read_live(client, [names.INFERENCE_POOL])[names.INFERENCE_POOL])
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "infra.cli", "inference"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.perf_counter() - t0 < timeout:
            if set(read_live(client, [names.INFERENCE_POOL])[names.INFERENCE_POOL]) - before:
                return time.perf_counter() - t0
            if proc.poll() is not None:
                raise SystemExit(f"the inference worker exited ({proc.returncode}) before it was live")
            time.sleep(0.02)
        raise SystemExit(f"no heartbeat within {timeout:.0f} s")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--starts", type=int, default=3)
    args = p.parse_args(argv)
    from bench.common import ROOT, cpu_name
    from infra.redis_server import RedisServer

    model = chosen_model(args)
    dtypes = args.dtypes.split(",")
    if args.quick:
        args.starts, dtypes = 1, dtypes[:1]
    server = RedisServer(Path(tempfile.mkdtemp(prefix="conveyor-cold-")))
    url = server.start()
    rows = []
    try:
        for dtype in dtypes:
            live, phases = [], []
            for _ in range(args.starts):  # alternating the two measurements, each in a fresh process
                live.append(worker_live(model, dtype, url))
                out = subprocess.run([sys.executable, "-c", PHASES, model, dtype], cwd=ROOT, capture_output=True,
                                     text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
                phases.append(json.loads(out.stdout.strip().splitlines()[-1]))

            def med(key: str, phases: list[dict[str, float]] = phases) -> float:
                return statistics.median(ph[key] for ph in phases)
            rows.append(f"| {dtype} | {statistics.median(live):.1f} ({min(live):.1f}-{max(live):.1f}) | "
                        f"{med('import'):.1f} | {med('load'):.1f} | {med('first') * 1000:.0f} | "
                        f"{med('again') * 1000:.0f} |")
    finally:
        server.stop()
    print(f"cold start: {os.path.basename(model.rstrip('/'))}, {cpu_name()}, median of {args.starts} starts\n")
    print("| dtype | worker live, s (range) | import torch + engine, s | model load, s | first request, ms "
          "| same again, ms |")
    print("|---|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    print("\nA request: 40 prompt tokens, 16 new, greedy, alone.")
    return 0
