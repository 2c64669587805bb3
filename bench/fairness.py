"""Fair share under a flood: first in, first out (FAIR_SHARE=false) against the fair queue, in one run,
alternating, each on a fresh stack of its own (its own embedded Redis, keys required).

A heavy tenant submits --heavy jobs of --heavy-tokens at once; a light tenant then sends --light jobs of
--light-tokens, one every --light-every seconds. Before the flood the light tenant sends the same jobs
alone. Reported per mode, medians over --rounds: the light tenant's TTFT p50/p95 alone and under the
flood and its median completion time, the heavy backlog's drain time and throughput (fair must reach
FIFO's: fairness costs no throughput), and Redis commands per job (INFO commandstats over the flood;
scripts count their inner calls; this benchmark's own reads left out). Times come from the job records
(created_at, first_token_at, finished_at), as the service stamped them.

    .venv/bin/python -m bench fairness                  # the default model, 200 x 64 against 10 x 8, 2 rounds
    .venv/bin/python -m bench fairness --quick          # seconds: the tiny model, 16 x 8 against 2 x 4, 1 round
    .venv/bin/python -m bench fairness --modes fair --heavy 24 --heavy-prompt 4000 --heavy-tokens 1 \
        --heavy-priority -1000 --light 6 --light-tokens 16    # long prompts at the best priority, inside a worker
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from bench.common import chosen_model, parser, percentile
from harness.stack import Stack, start_stack, stop_stack, until
from shared import names, tenants
from shared.jobs import TERMINAL


def _submit(c: httpx.Client, tokens: int, i: int, prompt_ids: int = 0, priority: int = 0) -> str:
    body: dict[str, Any] = {"prompt": f"Write about the number {i}.", "max_tokens": tokens, "ignore_eos": True,
                            "priority": priority}
    if prompt_ids:  # a long prompt of its own (distinct ids: nothing from the prefix cache)
        del body["prompt"]
        body["prompt_token_ids"] = [200 + (i * 7919 + k * 104729) % 40000 for k in range(prompt_ids)]
    r = c.post("/v1/jobs", json=body)
    r.raise_for_status()
    return str(r.json()["id"])


SENT = {"commands": 0}  # what this benchmark sends Redis itself (its reads of the records), left out of the counts


def _records(stack: Stack, ids: list[str], timeout: float) -> list[dict[str, str]]:
    """The jobs' records once every one has ended (one read a second)."""
    r = stack.redis()

    def ended() -> list[dict[str, str]] | None:
        pipe = r.pipeline(transaction=False)
        for job_id in ids:
            pipe.hgetall(names.job_key(job_id))
        recs = pipe.execute()
        SENT["commands"] += len(ids)
        return recs if all(rec.get("status") in TERMINAL for rec in recs) else None

    return until(f"{len(ids)} jobs to end", ended, timeout, every=1.0)


def _light(c: httpx.Client, args: argparse.Namespace, offset: int) -> list[str]:
    ids = []
    for i in range(args.light):
        ids.append(_submit(c, args.light_tokens, offset + i))
        time.sleep(args.light_every)  # the workload: one light request every light_every seconds
    return ids


def _commands(stack: Stack) -> int:
    return sum(int(v["calls"]) for v in stack.redis().info("commandstats").values())


def run_mode(fair: bool, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    stack = start_stack(workdir, None, args.model, {"AUTH": "required", "FAIR_SHARE": "true" if fair else "false",
                                                    "MAX_NUM_SEQS": str(args.max_num_seqs), "DTYPE": args.dtype,
                                                    "MAX_QUEUE_WAIT_S": "86400"})  # the flood is admitted whole
    try:
        r = stack.redis()
        heavy_key, _ = tenants.create(r, "heavy", rpm=0, tpm=0, max_queued=0)
        light_key, _ = tenants.create(r, "light", rpm=0, tpm=0, max_queued=0)
        heavy = httpx.Client(base_url=stack.url, timeout=60, headers={"Authorization": f"Bearer {heavy_key}"})
        light = httpx.Client(base_url=stack.url, timeout=60, headers={"Authorization": f"Bearer {light_key}"})
        alone = _records(stack, _light(light, args, 0), 600)
        commands0, sent0 = _commands(stack), SENT["commands"]
        with ThreadPoolExecutor(8) as pool:
            flood = list(pool.map(lambda i: _submit(heavy, args.heavy_tokens, i, args.heavy_prompt,
                                                    args.heavy_priority), range(args.heavy)))
        under = _records(stack, _light(light, args, args.light), 1800)
        heavy_recs = _records(stack, flood, 3600)
        commands = _commands(stack) - commands0 - (SENT["commands"] - sent0) - 1  # and the INFO before
    finally:
        stop_stack(stack)
    ttft = lambda recs: [float(x["first_token_at"]) - float(x["created_at"]) for x in recs]  # noqa: E731
    drain = max(float(x["finished_at"]) for x in heavy_recs) - min(float(x["created_at"]) for x in heavy_recs)
    return {
        "mode": "fair" if fair else "fifo",
        "light_ttft_alone_p50": percentile(ttft(alone), 50), "light_ttft_alone_p95": percentile(ttft(alone), 95),
        "light_ttft_p50": percentile(ttft(under), 50), "light_ttft_p95": percentile(ttft(under), 95),
        "light_done_p50": statistics.median(float(x["finished_at"]) - float(x["created_at"]) for x in under),
        "drain_s": drain,
        "heavy_tok_s": sum(int(x.get("completion_tokens") or 0) for x in heavy_recs) / drain,
        "failed": sum(x["status"] != "succeeded" for x in [*alone, *under, *heavy_recs]),
        "commands_per_job": commands / (args.heavy + args.light),
    }


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--heavy", type=int, default=200)
    p.add_argument("--heavy-tokens", type=int, default=64)
    p.add_argument("--light", type=int, default=10)
    p.add_argument("--heavy-prompt", type=int, default=0, help="the heavy jobs' prompts: this many token ids each "
                                                                  "(0: a short sentence)")
    p.add_argument("--heavy-priority", type=int, default=0, help="the heavy jobs' priority (lower first, within "
                                                                   "their tenant)")
    p.add_argument("--light-tokens", type=int, default=8)
    p.add_argument("--light-every", type=float, default=1.0)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--modes", default="fifo,fair", help="which to run: fifo, fair or both (the default)")
    p.add_argument("--json", dest="json_out")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.heavy, args.heavy_tokens = 1, 16, 8
        args.light, args.light_tokens, args.light_every, args.max_num_seqs = 2, 4, 0.1, 4
    args.model = chosen_model(args)
    workdir = Path(tempfile.mkdtemp(prefix="conveyor-fairness-"))
    modes = [m for m in ("fifo", "fair") if m in args.modes.split(",")]
    runs = []
    for rnd in range(args.rounds):
        for mode in (modes if rnd % 2 == 0 else modes[::-1]):  # alternating: neither mode always first
            runs.append(run_mode(mode == "fair", args, workdir / f"{rnd}-{mode}"))
            print(json.dumps(runs[-1]), flush=True)
    keys = [k for k in runs[0] if k != "mode"]
    med = {mode: {k: statistics.median(r[k] for r in runs if r["mode"] == mode) for k in keys} for mode in modes}
    print(f"\n{args.heavy} x {args.heavy_tokens} heavy against {args.light} x {args.light_tokens} light (one every "
          f"{args.light_every} s), MAX_NUM_SEQS {args.max_num_seqs}, {args.model}, medians of {args.rounds} round(s)\n")
    print("| | " + " | ".join(modes) + (" | fair / FIFO |\n|---|---|---|---|" if len(modes) == 2 else " |\n|---|---|"))
    rows = [("light TTFT p50 alone, s", "light_ttft_alone_p50"), ("light TTFT p95 alone, s", "light_ttft_alone_p95"),
            ("light TTFT p50 under the flood, s", "light_ttft_p50"),
            ("light TTFT p95 under the flood, s", "light_ttft_p95"),
            ("light completion p50 under the flood, s", "light_done_p50"), ("heavy drain, s", "drain_s"),
            ("heavy throughput, tok/s", "heavy_tok_s"), ("Redis commands per job", "commands_per_job"),
            ("jobs not succeeded", "failed")]
    for label, k in rows:
        cells = [f"{med[m][k]:.3g}" for m in modes]
        if len(modes) == 2:
            a, b = med["fifo"][k], med["fair"][k]
            cells.append(f"{b / a:.2f}x" if a else "")
        print(f"| {label} | " + " | ".join(cells) + " |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"runs": runs, "medians": med}, indent=1))
    return 0
