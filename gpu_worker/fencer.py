"""The output lane's fences, off its loop: on a Redis Cluster a job is reported Done (its stream entry acknowledged
next) only once a replica of its record's master has its end (shared/fence.py), and waiting for that in the lane's
own loop would hold every job's output while one master's replica lags (up to LAGGING_S). A thread of its own, with
a cluster client of its own, confirms the ends a step wrote and reports each Done as its master confirms; those not
confirmed (a lagging replica, a failover that may have lost them, a failed connection) go back to the lane, which
writes them again (replays where they stood) and hands them back (`OutputLane.refence`).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from shared import names
from shared.fence import Fence
from shared.redis_client import heal, sync_client

log = logging.getLogger("conveyor.output_lane")

# a reply (a WAIT's included) is waited for at most this long: a paused node (connected, silent) asked for the slot
# map would hold the thread for good, every end waiting behind it
FENCE_TIMEOUT_S = 5.0
FAILED_PAUSE_S = 0.1  # after a round that left some end unconfirmed: a failed connection is not asked again at once


class Fencer:
    """Ends waiting for a replica: `submit` them; `copied` is called (from this thread) with those confirmed,
    `again` receives those not."""

    def __init__(self, redis_url: str, copied: Callable[[list[str]], None]) -> None:
        self.client = sync_client(redis_url, decode=False, timeout=FENCE_TIMEOUT_S)
        self.fence = Fence(self.client)  # type: ignore[arg-type]
        self.copied = copied
        self.again: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._todo: queue.SimpleQueue[list[str] | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fencer", daemon=True)
        self._thread.start()

    def submit(self, job_ids: list[str]) -> None:
        self._todo.put(job_ids)

    def close(self) -> None:
        self._stop.set()
        self._todo.put(None)
        self._thread.join(timeout=5)
        self.client.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            batch = self._todo.get()
            while batch is not None and not self._todo.empty():  # every end waiting, in one round
                more = self._todo.get_nowait()
                batch = None if more is None else batch + more
            if batch is None:
                return
            try:
                left = set(self.fence.not_copied([names.job_key(j) for j in batch]))
            except Exception:  # noqa: BLE001 - the thread goes on: the ends are asked again
                log.exception("the ends of %d jobs could not be confirmed", len(batch))
                heal(self.client)  # (a slot the map does not cover: read it again)
                left = {names.job_key(j) for j in batch}
            self.copied([j for j in batch if names.job_key(j) not in left])
            for job_id in batch:
                if names.job_key(job_id) in left:
                    self.again.put(job_id)
            if left:
                self._stop.wait(FAILED_PAUSE_S)
