"""Metric names (vLLM's, under `conveyor:`) and the histograms workers keep in Redis.

Workers accumulate observations locally and add them to one Redis hash per histogram every
second, so a single scrape of any API process sees the whole system. A `Flusher` adds them from a thread of its
own: the hashes lie on whichever nodes of a cluster their names hash to, and one that does not answer holds only it."""

from __future__ import annotations

import bisect
import logging
import queue
import threading
from typing import Any

from shared import names

log = logging.getLogger(__name__)

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

    def take(self) -> Histograms:
        """What was counted since the last take; this one counts from nothing again."""
        taken = Histograms()
        taken.counts, taken.sums, taken.counters = self.counts, self.sums, self.counters
        self.__init__()  # type: ignore[misc]
        return taken

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


class Flusher:
    """Histograms' increments added in Redis by a thread of its own (with a client of its own), so that a node that
    does not answer (down, paused, cut off) holds up no caller's loop. At most WAITING flushes wait for it; one past
    that is dropped, as one that fails is (metrics, not records: a count lost in an outage is not worth a stall)."""

    WAITING = 8

    def __init__(self, client: Any) -> None:
        self.client = client
        self._todo: queue.Queue[Histograms | None] = queue.Queue(maxsize=self.WAITING)
        self._thread = threading.Thread(target=self._run, name="metrics", daemon=True)
        self._thread.start()

    def flush(self, metrics: Histograms) -> None:
        try:
            self._todo.put_nowait(metrics.take())
        except queue.Full:
            log.warning("metrics dropped: Redis has not taken the last %d flushes", self.WAITING)

    def close(self, timeout: float = 1.0) -> None:
        """After the flushes waiting (for at most `timeout`)."""
        try:
            self._todo.put(None, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)
        self.client.close()

    def _run(self) -> None:
        while (taken := self._todo.get()) is not None:
            pipe = self.client.pipeline(transaction=False)
            taken.flush(pipe)
            try:
                pipe.execute()
            except Exception as exc:  # noqa: BLE001 - the thread goes on: an outage, or a refusal
                log.warning("metrics flush failed: %s", exc)
