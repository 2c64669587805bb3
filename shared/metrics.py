"""Metric names (vLLM's, under `conveyor:`) and the histograms workers keep in Redis.

Workers accumulate observations locally and add them to one Redis hash per histogram every
second, so a single scrape of any API process sees the whole system."""

from __future__ import annotations

import bisect
from typing import Any

from shared import names

TTFT = "conveyor:time_to_first_token_seconds"
ITL = "conveyor:inter_token_latency_seconds"
E2E = "conveyor:e2e_request_latency_seconds"
QUEUE = "conveyor:request_queue_time_seconds"
HISTOGRAMS = {
    TTFT: (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0),
    ITL: (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5),
    E2E: (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0),
    QUEUE: (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
}
PROMPT_TOKENS = "conveyor:prompt_tokens_total"
GENERATION_TOKENS = "conveyor:generation_tokens_total"
REQUEST_SUCCESS = "conveyor:request_success_total"


class Histograms:
    """Local bucket counts (non-cumulative), flushed into Redis as increments."""

    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = {n: [0] * (len(b) + 1) for n, b in HISTOGRAMS.items()}
        self.sums: dict[str, float] = dict.fromkeys(HISTOGRAMS, 0.0)
        self.counters: dict[str, float] = {}

    def observe(self, name: str, value: float) -> None:
        self.counts[name][bisect.bisect_left(HISTOGRAMS[name], value)] += 1
        self.sums[name] += value

    def inc(self, name: str, value: float = 1.0) -> None:
        self.counters[name] = self.counters.get(name, 0.0) + value

    def flush(self, pipe: Any) -> None:
        for name, counts in self.counts.items():
            n = sum(counts)
            if not n:
                continue
            fields = {str(i): c for i, c in enumerate(counts) if c}
            for f, c in fields.items():
                pipe.hincrby(names.hist_key(name), f, c)
            pipe.hincrbyfloat(names.hist_key(name), "sum", self.sums[name])
            pipe.hincrby(names.hist_key(name), "count", n)
            self.counts[name] = [0] * len(counts)
            self.sums[name] = 0.0
        for name, v in self.counters.items():
            pipe.hincrbyfloat(names.STATS_KEY, name, v)
        self.counters = {}


def read_histogram(raw: dict[str, str], name: str) -> tuple[list[tuple[str, float]], float]:
    """Cumulative Prometheus buckets and the sum, from the Redis hash."""
    bounds = HISTOGRAMS[name]
    acc, buckets = 0.0, []
    for i, b in enumerate(bounds):
        acc += float(raw.get(str(i), 0))
        buckets.append((repr(b), acc))
    acc += float(raw.get(str(len(bounds)), 0))
    buckets.append(("+Inf", acc))
    return buckets, float(raw.get("sum", 0.0))
