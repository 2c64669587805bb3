"""What n-gram speculative decoding (SPECULATIVE=ngram) gains where the output copies the prompt (editing a
text) and costs where it does not (open questions): output tok/s of the same requests with it off and on, in
one engine, one process, interleaved, median over rounds; the engine steps, the draft tokens kept, and whether
every run gave the same tokens (float32 always does; bfloat16 results shift with a batch's shape, on or off).

    .venv/bin/python -m bench engine speculative                    # default model, 1 and 8 streams, 3 rounds
    .venv/bin/python -m bench engine speculative --quick            # tiny model, seconds
"""

from __future__ import annotations

import os
import statistics
import time

from bench.common import chosen_model, parser

# an edit keeps most of its text: the model's answer copies long runs of the prompt
PASSAGE = ("The old lighthouse stood at the edge of the cliff for more than a hundred years. Every night its "
           "keeper climbed the narrow stairs, cleaned the great lens and lit the lamp, so that the fishing boats "
           "could find their way home through the fog. When the keeper grew old, his daughter took over the work. "
           "She kept a journal of every ship that passed, every storm that shook the windows, and every quiet "
           "morning when the sea lay flat and grey under the rising sun.")
EDIT = "Rewrite the following text in the past perfect tense, changing nothing else:\n\n" + PASSAGE


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--streams", default="1,8", help="concurrent requests per run, comma-separated")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--draft", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--lookup", default="2,4", help="prompt_lookup_min,max")
    args = p.parse_args(argv)
    from bench.common import PROMPTS, cpu_name

    model = chosen_model(args)
    streams = [int(s) for s in args.streams.split(",")]
    if args.quick:
        streams, args.tokens, args.rounds = [2], 8, 1
    import torch

    from gpu_worker.engine import EngineConfig, LLMEngine
    from gpu_worker.engine.ngram import NgramConfig
    from shared.schemas import GenerationRequest, Request
    from workers.tokenizer.prompt import PromptBuilder

    lo, hi = (int(x) for x in args.lookup.split(","))
    spec = NgramConfig(args.draft, lo, hi)
    engine = LLMEngine(EngineConfig(model=model, dtype=args.dtype, max_num_seqs=max(streams)))
    pb = PromptBuilder(model)

    def encode(questions: list[str]) -> list[list[int]]:
        texts = [pb.render(GenerationRequest(messages=[{"role": "user", "content": q}])) for q in questions]
        return pb.encode_batch(texts, [False] * len(texts))

    workloads = {"edit a text": encode([EDIT]), "open questions": encode(PROMPTS)}

    def run(workload: str, n: int, on: bool, tag: str) -> tuple[float, int, int, int, list[list[int]]]:
        """(output tok/s, steps, draft tokens, kept, outputs) of n requests of the workload, greedy, all at once."""
        engine.config.speculative = spec if on else None
        prompts = workloads[workload]
        drafted, kept = engine.speculation()
        for i in range(n):
            engine.add_request(Request(f"{tag}-{i}", prompts[i % len(prompts)], max_tokens=args.tokens,
                                       temperature=0.0))
        out: dict[str, list[int]] = {f"{tag}-{i}": [] for i in range(n)}
        tokens, steps, t = 0, 0, time.perf_counter()
        while engine.has_unfinished():
            for o in engine.step():
                out[o.id] += o.token_ids
                tokens += len(o.token_ids)
            steps += 1
        d, k = engine.speculation()
        return tokens / (time.perf_counter() - t), steps, d - drafted, k - kept, list(out.values())

    for workload in workloads:  # warm-up, and the prompts' blocks cached for every round alike
        run(workload, max(streams), False, f"warm-{workload}")
    rows = []
    for workload in workloads:
        for n in streams:
            got: dict[bool, list[tuple[float, int, int, int, list[list[int]]]]] = {False: [], True: []}
            for r in range(args.rounds):
                for on in ((False, True) if r % 2 == 0 else (True, False)):
                    got[on].append(run(workload, n, on, f"{workload}-{n}-{r}-{on}"))
            off_tps, on_tps = (statistics.median(x[0] for x in got[v]) for v in (False, True))
            steps_off, steps_on = got[False][0][1], got[True][0][1]
            drafted, kept = sum(x[2] for x in got[True]), sum(x[3] for x in got[True])
            same = all(x[4] == got[False][0][4] for x in got[True] + got[False])
            rows.append(f"| {workload} | {n} | {off_tps:.0f} | {on_tps:.0f} | {on_tps / off_tps:.2f}x | "
                        f"{steps_off} / {steps_on} | {kept / max(drafted, 1):.0%} | {'yes' if same else 'no'} | "
                        f"{', '.join(f'{x[0]:.0f}' for x in got[True])} |")
    print(f"speculative decoding (ngram, {args.draft} draft tokens, lookup {lo}-{hi}): "
          f"{os.path.basename(model.rstrip('/'))}, dtype {engine.runner.dtype}, greedy, up to {args.tokens} "
          f"tokens, {torch.get_num_threads()} threads, {cpu_name()}, median of {args.rounds} interleaved rounds\n")
    print("| workload | streams | off tok/s | on tok/s | on / off | steps off / on | drafts kept | same tokens "
          "| on, rounds |")
    print("|---|---:|---:|---:|---:|---|---:|---|---|")
    print("\n".join(rows))
    return 0
