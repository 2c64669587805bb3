"""The seed promise through the whole service: a seeded job's text alone, then among other clients' jobs, round after
round, in the default dtype (bfloat16 on a CPU with AVX512-BF16 or AMX).

    .venv/bin/python -m bench serve seeds                 # 20 rounds on the default model, DTYPE=auto
    .venv/bin/python -m bench serve seeds --quick         # 2 rounds on a tiny random model
    .venv/bin/python -m bench serve seeds --dtype float32

One stack (`conveyor up`, its own Redis). First each of --jobs seeded jobs (temperature 1, top-p 0.9, each its own
prompt and seed) runs alone, one after another: its reference text. Then each round submits them again at once
among --others other jobs (other prompts, some greedy, some seeded, lengths from 8 to 2x the seeded ones', some
sharing a seeded job's prompt so that its prefix comes from the cache): every seeded job must give its reference
text, token for token. A round fails if any differs; exit status 1 if any round failed.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from bench.common import PROMPTS, chosen_model, cpu_name, md_table, parser, tree_state
from harness.stack import start_stack, stop_stack

SAMPLED = {"temperature": 1.0, "top_p": 0.9}
_local = threading.local()  # a client per thread: one httpx client shared by many threads met EBADF on its sockets


def _client(url: str) -> httpx.Client:
    if getattr(_local, "client", None) is None:
        _local.client = httpx.Client(base_url=url, timeout=120)
    return _local.client  # type: ignore[no-any-return]


def _run(url: str, body: dict[str, Any]) -> Any:
    """Submit a job and wait for its end; its final record."""
    client = _client(url)
    while (resp := client.post("/v1/jobs", json=body)).status_code in (429, 503):
        time.sleep(float(resp.headers.get("retry-after", "1")))
    resp.raise_for_status()
    job_id = resp.json()["id"]
    while (job := client.get(f"/v1/jobs/{job_id}").json())["status"] in ("queued", "running"):
        time.sleep(0.1)
    return job


def _seeded(i: int, max_tokens: int) -> dict[str, Any]:
    return {"prompt": PROMPTS[i % len(PROMPTS)], "seed": 1000 + i, "max_tokens": max_tokens, "ignore_eos": True,
            **SAMPLED}


def _others(rng: random.Random, n: int, jobs: int, max_tokens: int) -> list[dict[str, Any]]:
    out = []
    for k in range(n):
        body: dict[str, Any] = {"max_tokens": rng.randint(8, 2 * max_tokens), "ignore_eos": True}
        if k % 4 == 0:  # a seeded job's prompt again: its prefix from the cache, its own sampling
            body["prompt"] = PROMPTS[rng.randrange(jobs) % len(PROMPTS)]
        else:
            body["prompt"] = f"{PROMPTS[rng.randrange(len(PROMPTS))]} Story {rng.randrange(10**6)}:"
        body.update({"temperature": 0.0} if k % 2 else {**SAMPLED, "seed": rng.randrange(2**31)})
        out.append(body)
    return out


def main(argv: list[str] | None = None) -> int:
    p: argparse.ArgumentParser = parser(__doc__)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--jobs", type=int, default=6, help="seeded jobs checked each round")
    p.add_argument("--others", type=int, default=26, help="other jobs beside them each round")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--dtype", default="auto", help="the stack's DTYPE (default: auto, as users run it)")
    args = p.parse_args(argv)
    rounds = 2 if args.quick else args.rounds
    model = chosen_model(args)
    tmp = Path(tempfile.mkdtemp(prefix="conveyor-seeds-"))
    stack = start_stack(tmp, None, model, {"DTYPE": args.dtype, "MAX_NUM_SEQS": "64"})
    rng = random.Random(0)
    rows, failed = [], 0
    try:
        with ThreadPoolExecutor(64) as pool:
            seeded = [_seeded(i, args.max_tokens) for i in range(args.jobs)]
            reference = [_run(stack.url, body)["text"] for body in seeded]
            for r in range(rounds):
                others = _others(rng, args.others, args.jobs, args.max_tokens)
                bodies = others[: len(others) // 2] + seeded + others[len(others) // 2:]
                t0 = time.monotonic()
                ended = list(pool.map(lambda b: _run(stack.url, b), bodies))
                wall = time.monotonic() - t0
                got = ended[len(others) // 2: len(others) // 2 + args.jobs]
                bad = [i for i, (job, ref) in enumerate(zip(got, reference)) if job.get("text") != ref]
                ok = all(j["status"] == "succeeded" for j in ended)
                failed += bool(bad) or not ok
                rows.append([r + 1, len(bodies), f"{wall:.1f}", f"{args.jobs - len(bad)} / {args.jobs}",
                             "yes" if ok else "**no**"])
                print(f"round {r + 1}: {args.jobs - len(bad)}/{args.jobs} seeded texts as alone, "
                      f"{len(bodies)} jobs in {wall:.1f} s", flush=True)
            resolved = _client(stack.url).get("/v1/models").json()["data"][0]["id"]
    finally:
        stop_stack(stack)
    print(f"\n# the seed promise through the service: {args.jobs} seeded jobs among {args.others} others, {rounds} "
          f"rounds; DTYPE={args.dtype}, model {resolved}; {cpu_name()}; {tree_state()}\n")
    print(md_table(["round", "jobs", "wall s", "seeded texts as alone", "all succeeded"], rows))
    print(f"\n{rounds - failed} / {rounds} rounds held")
    return 1 if failed else 0
