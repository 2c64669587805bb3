"""Waking a consumer that waits on every partition of a Redis Cluster.

On one Redis node a consumer waits on all its partitions in one blocking call (XREADGROUP over every stream,
BLPOP over every doorbell). A cluster's call reaches one slot, so a consumer there could only turn over its
partitions in short blocking reads: a sweep of them all twenty times a second, idle or not, in every tokenizer,
inference worker and after-job drain. Instead an idle consumer on a cluster:

1. sweeps its partitions; when it finds nothing,
2. arms its ring: in each partition whose flag was taken (or may have expired), the flag (`names.ring_key`, with
   a TTL) that holds the channel to ring (`names.ring_channel`), then that partition's read, in one pipeline;
3. waits on that channel, classic pub/sub (a message published on any node reaches every subscriber), up to its
   block time, and sweeps again when rung.

A script that appends to one of the group's streams or queues (submit.lua, fair_push.lua, fair_pop.lua when jobs
are left, finish.lua; the appends made without a script, see `channel_of`) takes the partition's flag (GETDEL) and
publishes on the channel it holds, if any, the flag's name as the message. An append either precedes the flag, and
the read after the flag finds it, or follows it, and rings. A ring names the flag it took: only that one is set
again before the next wait (every one every ARMED_MS / 2, and after a new subscription, in case rings went unheard or
flags expired), so a consumer woken once per job re-arms one partition, not all of them. A ring lost with its
connection (a failover) costs at most the block time, and a subscription is renewed every RENEW_S in case its node
went away without a word. An append costs one GETDEL, and rings at most once for each flag set: a busy consumer
sets none, an idle one at most every flag every ARMED_MS / 2.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis

from shared.redis_client import heal

log = logging.getLogger(__name__)

ARMED_MS = 5_000  # a flag outlives the longest wait (the block times here are at most 2 s) and a dead consumer
LISTEN_TIMEOUT_S = 0.5  # how long a subscription may take to be confirmed (a silent node's cost, once a LISTEN_AGAIN_S)
# a subscription not confirmed is not tried again for this long: meanwhile each wait runs to its end (a consumer
# turns its partitions over once per block time), rather than each waiting LISTEN_TIMEOUT_S on a silent node first
LISTEN_AGAIN_S = 2.0
# a subscription is made afresh this often: one whose node went away without a word (a partition, a host lost)
# hears nothing, and until it is renewed every wait runs to its end
RENEW_S = 30.0


class Ring:
    """One consumer's side: its flags, one per partition, and its subscription to the channel they name."""

    def __init__(self, client: redis.Redis | Any, keys: list[str], channel: str) -> None:
        self.client, self.keys, self.channel = client, keys, channel
        self._pubsub: Any = None
        self._since = 0.0
        self._rung: set[str] = set()  # flags taken since they were set (the rings heard name them)
        self._armed_at = 0.0  # when every flag was last set on this subscription (0: not yet)
        self._listen_at = 0.0  # when a subscription may be tried again (after one not confirmed)

    def listen(self) -> bool:
        """Subscribe to the channel unless subscribed; whether the subscription is confirmed. Arming before it is
        would let a ring go by unheard."""
        if self._pubsub is not None and time.monotonic() - self._since < RENEW_S:
            return True
        self.close()
        if time.monotonic() < self._listen_at:
            return False
        pubsub = self.client.pubsub()
        try:
            pubsub.subscribe(self.channel)
            deadline = time.monotonic() + LISTEN_TIMEOUT_S
            while (left := deadline - time.monotonic()) > 0:
                msg = pubsub.get_message(timeout=left)
                if msg is not None and msg["type"] in ("subscribe", b"subscribe"):
                    self._pubsub, self._since, self._armed_at = pubsub, time.monotonic(), 0.0
                    return True
        except redis.RedisError as exc:
            log.info("ring %s: not subscribed (%s)", self.channel, exc)
            heal(self.client)  # the next try goes by a fresh slot map
        pubsub.close()
        self._listen_at = time.monotonic() + LISTEN_AGAIN_S
        return False

    def to_arm(self) -> list[str]:
        """The flags to set before the next wait: those rung since they were set, or every one when the last full
        arming is half a flag's TTL old (or was not made on this subscription)."""
        now = time.monotonic()
        if now - self._armed_at > ARMED_MS / 2000:
            self._armed_at = now
            self._rung.clear()
            return list(self.keys)
        keys = [k for k in self.keys if k in self._rung]
        self._rung.clear()
        return keys

    def arm(self, pipe: Any, key: str) -> None:
        """Queue the flag `key` (one of this ring's) on a pipeline, before that partition's read."""
        pipe.set(key, self.channel, px=ARMED_MS)

    def wait(self, timeout_s: float) -> bool:
        """Wait up to timeout_s for a ring; whether one came (every ring pending is taken). Unsubscribed (its
        connection lost), it waits the time out and subscribes again at the next `listen`."""
        deadline = time.monotonic() + timeout_s
        rung = False
        try:
            while self._pubsub is not None and (left := deadline - time.monotonic()) > 0:
                msg = self._pubsub.get_message(timeout=0 if rung else left)
                if msg is None:
                    if rung:
                        return True
                    continue
                if msg["type"] in ("message", b"message"):
                    rung = True
                    data = msg["data"]
                    self._rung.add(data.decode() if isinstance(data, bytes) else str(data))
        except (redis.RedisError, OSError) as exc:
            log.info("ring %s: subscription lost (%s)", self.channel, exc)
            self.close()
        if rung:
            return True
        if (left := deadline - time.monotonic()) > 0:
            time.sleep(left)
        return False

    def close(self) -> None:
        if self._pubsub is not None:
            try:
                self._pubsub.close()
            except (redis.RedisError, OSError):
                pass
            self._pubsub = None


def channel_of(flag: bytes | str | None) -> str:
    """The channel a flag taken by GETDEL names ('' none: no consumer sleeps there). An append made without a
    script (`/tokenize`'s call, the batch driver's end) takes its partition's flag in the same pipeline and
    publishes on it."""
    return flag.decode() if isinstance(flag, bytes) else (flag or "")
