"""What batch invariance costs: the engine as it is against the engine without its mechanisms, interleaved in one
process so that a shared machine's drift hits both alike.

    git archive <commit before> | tar -x -C /tmp/before     # the sampler before (its top-p candidates in topk's order)
    .venv/bin/python -m bench engine invariance --against /tmp/before --dtypes bfloat16,float32
    .venv/bin/python -m bench engine invariance --quick            # seconds: a tiny random model

"before" is this engine with a single row over a long K not split in two (gemm.ONE_ROW_MAX_K), with AMX a batch's rows
in one call (gemm.AMX_MAX_ROWS), the other tree's top-p draw (`_draw_nucleus` of its gpu_worker/engine/sampler.py;
without --against, this tree's) and generated positions computed again by the prefill kernel (`generated_by_decode`
off). Per dtype:
- decode: step times at 1 and 32 running sequences of --prompt-len tokens, seeded (temperature 1, top-p 0.9) and
  greedy, the two engines alternating step by step on the same running sequences; medians of --steps each;
- the prefill burst: --burst distinct prompts of --burst-len token ids, 1 new token each, prefix caching off, all
  submitted at once (the default tokens per step): seconds until every request has its token, the two alternating
  burst by burst (fresh prompts each), medians of --repeats.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import chosen_model, parser


def _nucleus_of(tree: Path) -> Callable:
    spec = importlib.util.spec_from_file_location("sampler_before", tree / "gpu_worker/engine/sampler.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._draw_nucleus


class Switch:
    """Turns the invariance mechanisms of one engine on (`now`) and off (`before`)."""

    def __init__(self, engine: object, before_nucleus: Callable) -> None:
        from gpu_worker.engine import gemm, sampler

        self.engine, self.gemm, self.sampler = engine, gemm, sampler
        model = engine.runner.model  # type: ignore[attr-defined]
        self.gemms = [g for g in {id(g): g for g in (model.gemm, model.head_gemm)}.values() if hasattr(g, "max_rows")]
        self.saved = (gemm.ONE_ROW_MAX_K, sampler._draw_nucleus, engine.runner.generated_by_decode,  # type: ignore[attr-defined]
                      [g.max_rows for g in self.gemms])
        self.before_nucleus = before_nucleus

    def set(self, now: bool) -> None:
        off = (1 << 62, self.before_nucleus, False, [0] * len(self.gemms))
        k, nucleus, by_decode, rows = self.saved if now else off
        self.gemm.ONE_ROW_MAX_K, self.sampler._draw_nucleus = k, nucleus
        self.engine.runner.generated_by_decode = by_decode  # type: ignore[attr-defined]
        for g, max_rows in zip(self.gemms, rows, strict=True):
            g.max_rows = max_rows  # (AMX: calls of at most 32 rows; 0, one call)


def decode(model: str, dtype: str, rows: int, steps: int, prompt_len: int, seeded: bool,
           before_nucleus: Callable) -> dict[str, float]:
    from gpu_worker.engine import EngineConfig, LLMEngine
    from shared.schemas import Request

    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, max_num_seqs=max(64, rows)))
    switch = Switch(engine, before_nucleus)
    kw = {"temperature": 1.0, "top_p": 0.9} if seeded else {"temperature": 0.0}
    for i in range(rows):
        prompt = [100 + (i * 7 + j) % 3000 for j in range(prompt_len)]
        engine.add_request(Request(f"r{i}", prompt, max_tokens=10_000, seed=i, ignore_eos=True, **kw))
    while engine.num_waiting or any(s.num_uncomputed > 1 for s in engine.scheduler.running):
        engine.step()
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(2 * steps + 4):
        now = (i // 2) % 2 == i % 2  # now, before, before, now, ...: neither always goes first
        switch.set(now)
        t = time.perf_counter()
        engine.step()
        if i >= 4:
            times[now].append(time.perf_counter() - t)
    switch.set(True)
    return {"now": statistics.median(times[True]) * 1e3, "before": statistics.median(times[False]) * 1e3}


def burst(model: str, dtype: str, n: int, length: int, repeats: int, before_nucleus: Callable) -> dict[str, float]:
    import torch

    from gpu_worker.engine import EngineConfig, LLMEngine
    from shared.schemas import Request

    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, max_num_seqs=32, prefix_caching=False))
    switch = Switch(engine, before_nucleus)
    g = torch.Generator().manual_seed(0)
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(repeats + 1):  # the first pair warms up
        for now in ((True, False) if r % 2 else (False, True)):
            switch.set(now)
            prompts = [torch.randint(100, 20_000, (length,), generator=g).tolist() for _ in range(n if r else 2)]
            t = time.perf_counter()
            for i, p in enumerate(prompts):
                engine.add_request(Request(f"b{r}{int(now)}-{i}", p, max_tokens=1, temperature=0.0))
            while engine.has_unfinished():
                engine.step()
            if r:
                times[now].append(time.perf_counter() - t)
    switch.set(True)
    return {"now": statistics.median(times[True]), "before": statistics.median(times[False])}


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--against", help="the tree whose top-p draw is 'before' (default: this one)")
    p.add_argument("--dtypes", default="bfloat16")
    p.add_argument("--rows", default="1,32")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--burst", type=int, default=32)
    p.add_argument("--burst-len", type=int, default=452)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.steps, args.burst, args.burst_len, args.repeats = "1,4", 3, 4, 40, 1
    model = chosen_model(args)
    root = Path(args.against) if args.against else Path(__file__).resolve().parent.parent
    before_nucleus = _nucleus_of(root)
    print(f"| dtype | measure | invariant | before | invariant / before |  ({args.steps} steps a side, "
          f"{args.repeats} bursts a side, interleaved; medians)")
    print("|---|---|---:|---:|---:|")
    for dtype in args.dtypes.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            for seeded in (True, False):
                m = decode(model, dtype, rows, args.steps, args.prompt_len, seeded, before_nucleus)
                print(f"| {dtype} | decode step, {rows} rows, {'seeded top-p 0.9' if seeded else 'greedy'}, ms "
                      f"| {m['now']:.1f} | {m['before']:.1f} | {m['now'] / m['before']:.3f} |", flush=True)
        m = burst(model, dtype, args.burst, args.burst_len, args.repeats, before_nucleus)
        print(f"| {dtype} | prefill burst, {args.burst} x {args.burst_len} tokens, s | {m['now']:.2f} "
              f"| {m['before']:.2f} | {m['now'] / m['before']:.3f} |", flush=True)
    return 0
