"""What a forced tool call costs: 32 concurrent chat jobs against a running stack, with `tool_choice:
"required"`, with a `json_schema` response format, plain, and each constrained mode's twin ("plain, as ...": its
prompts and output lengths, unconstrained: what the grammar alone costs), in alternating rounds: output tokens per
second, each job's decode rate and time to first token, medians over the rounds; then the time a new tool
grammar costs its first request (compiled by the tokenizer pool) against the same tools again (loaded from
Redis's cache).

    .venv/bin/python -m bench serve tools --url http://127.0.0.1:8000 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from typing import Any

import httpx

MODEL = "SmolLM2-135M-Instruct"
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 14}},
          "required": ["city", "unit", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_forecast", "description": "The weather forecast for a city.",
                                           "parameters": PARAMS}}]
QUESTIONS = ["What is the weather in {} this week?", "Will it rain in {} tomorrow?", "Forecast for {} please."]
CITIES = ["Paris", "Lyon", "Rome", "Oslo", "Lima", "Cairo", "Quito", "Perth"]
MODES = {
    "plain": {},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": PARAMS}}},
    "tool_required": {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
}


def conversation(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": QUESTIONS[i % 3].format(CITIES[i % len(CITIES)])}]


# the unconstrained twin of each constrained mode: the same prompt tokens in, the same output lengths out
TWINS = {"json_schema": "plain, as json_schema", "tool_required": "plain, as tool_required"}


def bodies(mode: str, streams: int, max_tokens: int, lengths: dict[str, list[int]], tool_prompts: list[str],
           ) -> list[dict[str, Any]]:
    """One round's job bodies. A twin ("plain, as ..."): its constrained mode's prompts (the tool jobs' as the
    tokenizer pool renders them, as raw text) with no constraint, each job held to the output length its
    constrained job had in the round before (ignore_eos): the same tokens in and out, so what differs is the
    grammar's cost alone."""
    base = {"temperature": 0.7}
    twin_of = {twin: mode for mode, twin in TWINS.items()}
    if mode in twin_of:
        of = twin_of[mode]
        return [{**base, "max_tokens": lengths[of][i], "ignore_eos": True, "seed": i,
                 **({"prompt": tool_prompts[i]} if of == "tool_required" else {"messages": conversation(i)})}
                for i in range(streams)]
    return [{**base, "max_tokens": max_tokens, "seed": i, **MODES[mode], "messages": conversation(i)}
            for i in range(streams)]


async def burst(url: str, jobs_in: list[dict[str, Any]]) -> tuple[dict[str, float], list[int]]:
    """The jobs at once on the job path (/v1/jobs takes the chat routes' fields), timed by their own records:
    output tok/s over the burst, time to first token (the engine's first token: a call's first visible delta
    comes some tokens later), and each job's decode rate after its first token (median), which a shorter output
    or a longer prompt does not move. Also each job's output length, in submission order."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        jobs = await asyncio.gather(*(client.post("/v1/jobs", json=b) for b in jobs_in))
        ids = [j.raise_for_status().json()["id"] for j in jobs]
        ends: dict[str, dict[str, Any]] = {}
        while len(ends) < len(ids):
            await asyncio.sleep(0.2)
            for job in await asyncio.gather(*(client.get(f"/v1/jobs/{i}") for i in ids if i not in ends)):
                if job.json()["status"] not in ("queued", "running"):
                    ends[job.json()["id"]] = job.json()
    done = [ends[i] for i in ids]
    assert all(j["status"] == "succeeded" for j in done), [j["error"] for j in done if j["status"] != "succeeded"]
    tokens = sum(j["usage"]["completion_tokens"] for j in done)
    wall = max(j["finished_at"] for j in done) - min(j["created_at"] for j in done)
    rates = [(j["usage"]["completion_tokens"] - 1) / (j["finished_at"] - j["first_token_at"]) for j in done
             if j["usage"]["completion_tokens"] > 1 and j["finished_at"] > j["first_token_at"]]
    return ({"tok_s": tokens / wall, "decode_tok_s": statistics.median(rates),
             "ttft_s": statistics.median(j["first_token_at"] - j["created_at"] for j in done),
             "tokens": float(tokens),
             "prompt_tokens": statistics.median(j["usage"]["prompt_tokens"] for j in done)},
            [j["usage"]["completion_tokens"] for j in done])


def tool_prompts(streams: int) -> list[str]:
    """The text the tokenizer pool renders for each tool_required job (the service's own prompt builder)."""
    from bench.common import default_model
    from shared.schemas import GenerationRequest
    from workers.tokenizer.prompt import PromptBuilder

    builder = PromptBuilder(default_model())
    return [builder.render(GenerationRequest(messages=conversation(i), **MODES["tool_required"]))
            for i in range(streams)]


async def grammar_cost(url: str, samples: int) -> dict[str, float]:
    """A new tool set's first request (its grammar compiled) against the same request again (the grammar cached):
    the medians of the whole request's time, one token of output."""
    cold, warm = [], []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        for _ in range(samples):
            name = "f_" + uuid.uuid4().hex[:12]  # a tool set the cache has never seen
            tools = [{"type": "function", "function": {"name": name, "parameters": PARAMS}}]
            body = {"model": MODEL, "max_tokens": 1, "tools": tools, "tool_choice": "required",
                    "messages": [{"role": "user", "content": "Forecast for Paris."}]}
            for times in (cold, warm):
                start = time.perf_counter()
                (await client.post("/v1/chat/completions", json=body)).raise_for_status()
                times.append(time.perf_counter() - start)
    return {"cold_s": statistics.median(cold), "cached_s": statistics.median(warm)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench serve tools", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--grammar-samples", type=int, default=5)
    args = ap.parse_args(argv)
    prompts = tool_prompts(args.streams)
    lengths: dict[str, list[int]] = {}
    for mode in TWINS:  # warm: the grammar machinery loaded; the first lengths
        _, lengths[mode] = asyncio.run(burst(args.url, bodies(mode, args.streams, args.max_tokens, {}, prompts)))
    modes = [*MODES, *TWINS.values()]
    rows: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in (modes if r % 2 == 0 else list(reversed(modes))):
            row, out = asyncio.run(burst(args.url, bodies(mode, args.streams, args.max_tokens, lengths, prompts)))
            if mode in TWINS:
                lengths[mode] = out
            rows[mode].append(row)
            print(json.dumps({"round": r + 1, "mode": mode, **row}), flush=True)
    keys = ("tok_s", "decode_tok_s", "ttft_s", "tokens", "prompt_tokens")
    med = {mode: {k: statistics.median(x[k] for x in runs) for k in keys} for mode, runs in rows.items()}
    print("| mode | prompt tokens | tokens a round | output tok/s | vs plain | vs its twin | a stream's decode tok/s "
          "| vs its twin | TTFT (s) |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode, m in med.items():
        twin = med.get(TWINS.get(mode, ""), m)
        print(f"| {mode} | {m['prompt_tokens']:.0f} | {m['tokens']:.0f} | {m['tok_s']:.0f} | "
              f"{m['tok_s'] / med['plain']['tok_s']:.2f}x | {m['tok_s'] / twin['tok_s']:.2f}x | "
              f"{m['decode_tok_s']:.1f} | {m['decode_tok_s'] / twin['decode_tok_s']:.2f}x | {m['ttft_s']:.2f} |")
    cost = asyncio.run(grammar_cost(args.url, args.grammar_samples))
    print(f"a new tool grammar's first request: {cost['cold_s']:.2f} s; the same again: {cost['cached_s']:.2f} s")
    return 0
