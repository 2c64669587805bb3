"""One loop-and-retry policy for every long-running loop that talks to Redis.

`Backoff` is exponential with jitter and resets on success. `run_loop` calls a step until a stop
event is set: a Redis outage backs off (and is logged once per outage, not per try), any other
error is logged with its traceback and the loop pauses briefly, so one bad message never ends a
worker's loop. `call` retries one call through outages. `arun_loop` is the asyncio face.

Each takes `on_outage`, called after every failed try: a loop over a cluster client passes
`shared.redis_client.heal` of it there, so that each retry is sent against a fresh slot map.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from shared.redis_client import RETRYABLE

T = TypeVar("T")

ERROR_PAUSE_S = 0.5  # after an unexpected error: long enough not to spin, short enough not to stall


class Backoff:
    def __init__(self, base: float = 0.1, cap: float = 5.0) -> None:
        self.base, self.cap = base, cap
        self.delay = base
        self.failures = 0

    def reset(self) -> None:
        self.delay, self.failures = self.base, 0

    def next(self) -> float:
        """The next wait: the current delay plus up to 100% jitter; the delay then doubles."""
        wait = self.delay + random.random() * self.delay
        self.delay = min(self.delay * 2, self.cap)
        self.failures += 1
        return min(wait, self.cap)


def run_loop(step: Callable[[], object], stop: threading.Event, log: logging.Logger, name: str, *,
             on_outage: Callable[[], None] | None = None, base: float = 0.1, cap: float = 5.0) -> None:
    """Call `step()` until `stop` is set. `step` blocks or polls as it likes (a blocking read with
    a timeout); the loop only adds the retry policy."""
    backoff = Backoff(base, cap)
    while not stop.is_set():
        try:
            step()
            if backoff.failures:
                log.info("%s: redis reachable again", name)
            backoff.reset()
        except RETRYABLE as exc:
            if on_outage is not None:
                on_outage()
            if not backoff.failures:
                log.warning("%s: redis unavailable (%s); retrying with backoff", name, exc)
            stop.wait(backoff.next())
        except Exception:  # noqa: BLE001 - one bad item must not end the loop
            log.exception("%s: unexpected error", name)
            stop.wait(ERROR_PAUSE_S)


def call(fn: Callable[[], T], stop: threading.Event | None = None, *, attempts: int = 0,
         base: float = 0.1, cap: float = 5.0, log: logging.Logger | None = None, name: str = "",
         on_outage: Callable[[], None] | None = None) -> T:
    """`fn()`, retried through Redis outages: `attempts` tries (0: until it succeeds or `stop` is set;
    then the last error is raised). With `log`, an outage is logged once, and its end."""
    backoff = Backoff(base, cap)
    while True:
        try:
            result = fn()
        except RETRYABLE as exc:
            if (attempts and backoff.failures + 1 >= attempts) or (stop is not None and stop.is_set()):
                raise
            if log is not None and not backoff.failures:
                log.warning("%s: redis unavailable (%s); retrying with backoff", name, exc)
            if on_outage is not None:
                on_outage()
            wait = backoff.next()
            if stop is not None:
                stop.wait(wait)
            else:
                time.sleep(wait)
            continue
        if log is not None and backoff.failures:
            log.info("%s: redis reachable again", name)
        return result


async def arun_loop(step: Callable[[], Awaitable[object]], stop: asyncio.Event, log: logging.Logger, name: str, *,
                    base: float = 0.1, cap: float = 5.0,
                    on_outage: Callable[[], Awaitable[None]] | None = None) -> None:
    """`run_loop` for asyncio: await `step()` until `stop` is set."""
    backoff = Backoff(base, cap)
    while not stop.is_set():
        try:
            await step()
            if backoff.failures:
                log.info("%s: redis reachable again", name)
            backoff.reset()
        except asyncio.CancelledError:
            raise
        except RETRYABLE as exc:
            if not backoff.failures:
                log.warning("%s: redis unavailable (%s); retrying with backoff", name, exc)
            if on_outage is not None:
                await on_outage()
            await _wait(stop, backoff.next())
        except Exception:  # noqa: BLE001
            log.exception("%s: unexpected error", name)
            await _wait(stop, ERROR_PAUSE_S)


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        pass
