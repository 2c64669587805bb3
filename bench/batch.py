"""The Batch API against the same requests sent interactively, on one stack, alternating, medians over rounds:
lines/s and output tok/s of an N-line batch (upload to completion) against the N requests at 32 concurrent
streams; and an interactive stream's TTFT with no batch running against during one.

`--waves`: the engine in process, in engine steps (what the machine's load does not change): every slot runs
a batch line (priority 1000) of 32 tokens, all started together, and an interactive request (priority 0)
arrives k decode steps into them; the steps until its first token, for k = 0, 4, ..., 28.

    .venv/bin/python -m bench batch                  # the default model, 1,000 lines x 32 tokens, 2 rounds
    .venv/bin/python -m bench batch --quick          # seconds: the tiny model, 40 lines x 8 tokens, 1 round
    .venv/bin/python -m bench batch --waves          # the default model in process, 64 slots
"""

from __future__ import annotations

import io
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai

from bench.common import PROMPTS, chosen_model, parser
from harness.stack import start_stack, stop_stack


def _body(model: str, i: int, tokens: int) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "max_tokens": tokens, "temperature": 1.0, "seed": i}


def _sdk(model: str, i: int, tokens: int) -> dict[str, Any]:
    return {**_body(model, i, tokens), "extra_body": {"ignore_eos": True}}


def run_batch(oai: openai.OpenAI, model: str, n: int, tokens: int) -> tuple[float, int, str]:
    lines = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {**_body(model, i, tokens), "ignore_eos": True}}) + "\n" for i in range(n))
    t = time.perf_counter()
    f = oai.files.create(file=("bench.jsonl", io.BytesIO(lines.encode())), purpose="batch")
    batch = oai.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        time.sleep(0.2)
        batch = oai.batches.retrieve(batch.id)
    wall = time.perf_counter() - t
    out = [json.loads(x) for x in oai.files.content(batch.output_file_id).text.splitlines()]
    return wall, sum(o["response"]["body"]["usage"]["completion_tokens"] for o in out), batch.id


def run_interactive(oai: openai.OpenAI, model: str, n: int, tokens: int, streams: int) -> tuple[float, int]:
    def one(i: int) -> int:
        r = oai.chat.completions.create(**_sdk(model, i, tokens))  # type: ignore[call-overload]
        return int(r.usage.completion_tokens)

    t = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        total = sum(pool.map(one, range(n)))
    return time.perf_counter() - t, total


def ttft(oai: openai.OpenAI, model: str, probes: int) -> list[float]:
    out = []
    for i in range(probes):
        t = time.perf_counter()
        for chunk in oai.chat.completions.create(stream=True, **_sdk(model, 10_000 + i, 8)):  # type: ignore[call-overload]
            if chunk.choices and chunk.choices[0].delta.content:
                out.append(time.perf_counter() - t)
                break
    return out


def waves(model: str, slots: int, tokens: int) -> list[tuple[int, int, float]]:
    """(k, engine steps, seconds) from an interactive request's arrival k decode steps into a wave of batch
    lines filling every slot to its first token (`--waves`)."""
    from gpu_worker.engine import EngineConfig, LLMEngine
    from shared.limits import PRIORITY_MAX
    from shared.model_config import checkpoint_dtype
    from shared.schemas import Request

    engine = LLMEngine(EngineConfig(model=model, max_num_seqs=slots, checkpoint_dtype=checkpoint_dtype(model)))

    def prompt(w: int, i: int) -> list[int]:  # distinct: none is served from another's prefix
        return [100 + (w * 131 + i * 7 + j) % 9000 for j in range(40)]

    out = []
    for w, k in enumerate([0, 0, 4, 8, 12, 16, 20, 24, 28]):  # the first wave warms up
        lines = [f"w{w}l{i}" for i in range(slots)]
        for i, rid in enumerate(lines):
            engine.add_request(Request(rid, prompt(w, i), max_tokens=tokens, temperature=1.0, seed=i,
                                       ignore_eos=True, priority=PRIORITY_MAX))
        begun: set[str] = set()
        while len(begun) < slots:
            begun |= {o.id for o in engine.step() if o.token_ids}
        for _ in range(k):
            engine.step()
        probe = f"w{w}probe"
        engine.add_request(Request(probe, prompt(w, slots), max_tokens=8, temperature=1.0, ignore_eos=True))
        t, steps = time.perf_counter(), 1
        while not any(o.id == probe and o.token_ids for o in engine.step()):
            steps += 1
        if w:
            out.append((k, steps, time.perf_counter() - t))
        for rid in [*lines, probe]:
            engine.abort_request(rid)
        while engine.has_unfinished():
            engine.step()
    return out


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--lines", type=int, default=1000)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--probes", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--waves", action="store_true", help="the engine in process: TTFT in steps during a batch wave")
    p.add_argument("--slots", type=int, default=64, help="--waves: the engine's slots (MAX_NUM_SEQS)")
    args = p.parse_args(argv)
    model = chosen_model(args)
    if args.waves:
        rows = waves(model, args.slots, args.tokens)
        print(f"interactive first token during a wave of {args.slots} batch lines x {args.tokens} tokens, "
              f"{Path(model).name} in process\n")
        print("| arrives, steps into the wave | first token after, steps | s |")
        print("|---:|---:|---:|")
        for k, steps, s in rows:
            print(f"| {k} | {steps} | {s:.2f} |")
        print(f"\nsteps: mean {statistics.mean(r[1] for r in rows):.1f}, max {max(r[1] for r in rows)}")
        return 0
    if args.quick:
        args.lines, args.tokens, args.probes, args.rounds = 40, 8, 2, 1
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp:
        stack = start_stack(Path(tmp), None, model, {"MAX_QUEUED": "100000"})
        try:
            oai = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=3, timeout=600)
            served = oai.models.list().data[0].id
            res: dict[str, list[float]] = {"batch": [], "interactive": [], "ttft_idle": [], "ttft_batch": []}
            ttft(oai, served, 1)  # warm-up
            for _ in range(args.rounds):
                wall, toks, _ = run_batch(oai, served, args.lines, args.tokens)
                res["batch"].append(toks / wall)
                wall_i, toks_i = run_interactive(oai, served, args.lines, args.tokens, args.streams)
                res["interactive"].append(toks_i / wall_i)
                res["ttft_idle"] += ttft(oai, served, args.probes)
                with ThreadPoolExecutor(1) as pool:  # the probes while a batch runs
                    running = pool.submit(run_batch, oai, served, args.lines, args.tokens)
                    time.sleep(2.0 if not args.quick else 0.5)
                    res["ttft_batch"] += ttft(oai, served, args.probes)
                    running.result()
        finally:
            stop_stack(stack)
    b, i = statistics.median(res["batch"]), statistics.median(res["interactive"])
    print(f"batch: {Path(model).name}, {args.lines} lines x {args.tokens} tokens, interactive at {args.streams} "
          f"streams, {args.rounds} rounds alternating\n")
    print("| | output tok/s | lines/s | rounds |")
    print("|---|---:|---:|---|")
    for name, v in (("batch", res["batch"]), ("interactive", res["interactive"])):
        med = statistics.median(v)
        print(f"| {name} | {med:.0f} | {med / args.tokens:.1f} | {', '.join(f'{x:.0f}' for x in v)} |")
    print(f"\nbatch / interactive: {b / i:.2f}x")

    def pct(v: list[float], q: float) -> float:
        v = sorted(v)
        return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]

    print(f"interactive TTFT p50/p95: no batch {pct(res['ttft_idle'], 0.5):.2f}/{pct(res['ttft_idle'], 0.95):.2f} s, "
          f"during a batch {pct(res['ttft_batch'], 0.5):.2f}/{pct(res['ttft_batch'], 0.95):.2f} s")
    return 0
