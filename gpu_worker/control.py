"""The control lane: cancellations the API publishes become aborts in the engine's inbox, so the
job's batch slot is freed at the next step. An abort for a job not running here is harmless."""

from __future__ import annotations

import logging
import threading
from queue import SimpleQueue

import orjson
import redis

from gpu_worker.messages import Abort, EngineCommand
from shared import names
from shared.jobs import FinishReason
from shared.redis_client import heal
from shared.retry import run_loop

log = logging.getLogger("conveyor.inference")


class ControlLane:
    def __init__(self, client: redis.Redis, inbox: SimpleQueue[EngineCommand], stop: threading.Event) -> None:
        self.client, self.inbox, self.stop = client, inbox, stop

    def run(self) -> None:
        run_loop(self.listen, self.stop, log, "control lane", base=0.5, on_outage=lambda: heal(self.client))

    def listen(self) -> None:
        """One subscription, until the connection drops (then run_loop subscribes again)."""
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        try:
            pubsub.subscribe(names.CONTROL_CHANNEL)
            while not self.stop.is_set():
                msg = pubsub.get_message(timeout=1.0)
                if msg is not None:
                    self.handle(msg["data"])
        finally:
            pubsub.close()

    def handle(self, data: bytes) -> None:
        try:
            body = orjson.loads(data)
        except orjson.JSONDecodeError:
            log.warning("control message is not JSON: %r", data[:200])
            return
        if isinstance(body, dict) and body.get("op") == "cancel" and isinstance(body.get("job_id"), str):
            self.inbox.put(Abort(body["job_id"], FinishReason.cancelled))
