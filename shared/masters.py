"""A Redis Cluster's masters as a consumer of every partition sees them: which master holds each partition's slot,
and which of them do not answer (dead, paused, cut off, failing over).

A consumer of every partition (a tokenizer's read, an inference worker's pop and start, their upkeep) sends each
master's share of a call in a plain pipeline of its own, on a client that does not retry and waits FAST_TIMEOUT_S at
most for a reply. A master that does not answer is passed over from then on, and a thread of its own probes it
(PING every PROBE_S, the slot map read again every HEAL_S) until it answers or the map no longer names it: once a
replica holds its slots, they are read there (another node, not passed over). A silent master costs a consumer one
FAST_TIMEOUT_S, when it is found so; one master's outage holds back its own partitions' jobs, not every partition's,
and none for longer than its own outage. On a single Redis every key has the one node, and nothing is passed over.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import redis
from redis.exceptions import AskError, MovedError

from shared.redis_client import CLUSTER_TYPES, RETRYABLE, heal, is_cluster, sync_client

log = logging.getLogger(__name__)

K = TypeVar("K")
FAST_TIMEOUT_S = 0.5  # how long the fail-fast client waits for a reply (a silent master costs this once)
PROBE_S = 0.25  # a master passed over is probed this often
HEAL_S = 1.0  # and the slot map read again this often meanwhile (its replica may have taken over)
# what says a master does not answer (its connection failed or timed out): passed over; a refusal (OOM, NOREPLICAS,
# TRYAGAIN) is answered at once, and only read again
SILENT = (redis.ConnectionError, redis.TimeoutError, OSError)
REDIRECTED = (MovedError, AskError)  # a reply from a master the slot left (a failover): the map is read again


class Elsewhere(Exception):
    """A partition's work needs a key of another master (one not partitioned: a registry), which does not answer
    now (noted: `Masters.fail`): the work waits for it, its own partition's master not blamed."""


def silent(exc: BaseException) -> bool:
    """Whether the error says a master did not answer (SILENT; a cluster client that reached no node raises it as
    the cause of a RedisClusterUnreachableError)."""
    return isinstance(exc, SILENT) or isinstance(exc.__cause__, SILENT)


def fail_fast(url: str) -> redis.Redis | None:
    """For a cluster's URL, a client that does not retry and waits FAST_TIMEOUT_S at most for a reply (bytes, as
    the workers read): what a consumer of every partition reads each master with. None for a single Redis."""
    return sync_client(url, decode=False, retries=0, timeout=FAST_TIMEOUT_S) if is_cluster(url) else None


class Masters:
    """The masters of `client`'s cluster (a fail-fast client: no retries, a short read timeout), and which are down
    for now."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.cluster = isinstance(client, CLUSTER_TYPES)
        self._down: set[str] = set()  # masters (host:port) passed over: each probed by a thread of its own
        self._lock = threading.Lock()
        # masters that did not answer a call since they last did: its command may have run all the same, once the
        # master went on, its reply gone with the connection (a read, a pop: entries now pending for their caller)
        self._missed: set[str] = set()
        self._back: set[str] = set()  # of those, the ones that answered since (`take_back`)
        self.last_missed: str | None = None  # the master that missed a call last: asked last for the slot map
        # when a master that missed calls last answered again, or was found replaced (time.monotonic()): its
        # workers' heartbeats and refreshes were held back meanwhile, so nothing idle is taken for a dead
        # worker's for a while after (`StreamConsumer.claim_stale`)
        self.back_at = float("-inf")

    def node(self, key: str) -> Any:
        """The master of the key's slot in the client's map (None: a single Redis, or none known)."""
        if not self.cluster:
            return None
        try:
            return self.client.get_node_from_key(key)
        except (redis.RedisError, *RETRYABLE):
            return None

    def is_down(self, key: str) -> bool:
        """Whether the master of the key's slot is passed over (it did not answer, and has not since)."""
        node = self.node(key)
        return node is not None and node.name in self._down

    def groups(self, items: Iterable[K], key: Callable[[K], str]) -> list[tuple[Any, list[K]]]:
        """The items by the master of their key's slot, in their order within each, those of a master that is
        down left out (one group, node None, on a single Redis)."""
        if not self.cluster:
            return [(None, list(items))]
        out: dict[str, tuple[Any, list[K]]] = {}
        for item in items:
            node = self.node(key(item))
            if node is None or node.name in self._down:
                continue  # (no map: read again by the next failure's heal)
            out.setdefault(node.name, (node, []))[1].append(item)
        return list(out.values())

    def pipeline(self, key: str) -> Any:
        """A plain pipeline to the master of the key's slot (the client's own on a single Redis), for one
        partition's commands: a master that does not answer fails it once, for its timeout (a cluster client's
        pipeline sends each command of a failed node again, one by one, each waiting out the timeout). Its
        `execute` raises the first error reply (a redirection among them: REDIRECTED)."""
        if not self.cluster:
            return self.client.pipeline(transaction=False)
        node = self.node(key)
        if node is None:
            raise redis.ConnectionError(f"no master known for {key!r}")
        return self.client.get_redis_connection(node).pipeline(transaction=False)

    def send(self, node: Any, fill: Callable[[Any], None]) -> list[Any] | None:
        """The commands `fill` queues, in one plain pipeline to `node` (the client's own on a single Redis): their
        replies, errors as exceptions (a redirection among them: the slot map is read again); None when the master
        did not answer (passed over, the slot map read again). A single Redis's failure raises, as any call's."""
        pipe = self.client.pipeline(transaction=False) if node is None else \
            self.client.get_redis_connection(node).pipeline(transaction=False)
        fill(pipe)
        try:
            replies = list(pipe.execute(raise_on_error=False))
        except RETRYABLE as exc:
            if node is None:
                raise
            self.fail(node, exc)
            return None
        self.answered(node)
        if any(isinstance(r, REDIRECTED) for r in replies):
            heal(self.client)
        return replies

    def answered(self, node: Any) -> None:
        """The master answered a call."""
        with self._lock:
            if node is None or node.name not in self._missed:
                return
            self._missed.discard(node.name)
            self._back.add(node.name)
            self.back_at = time.monotonic()
        log.info("master %s answers again", node.name)

    def take_back(self) -> set[str]:
        """The masters that answered again since they missed a call (each once): their calls' lost replies are to
        be looked for (`StreamConsumer.lost`)."""
        with self._lock:
            back, self._back = self._back, set()
        return back

    def look_again(self, masters: Iterable[str]) -> None:
        """Masters whose lost replies were not all read back (no reply, or an error): looked for again."""
        with self._lock:
            self._back.update(masters)

    def fail(self, node: Any, exc: BaseException) -> None:
        """After a failed call to the master: pass it over where it did not answer (SILENT) until its probe finds
        it answering, or not a master any more; read the slot map again."""
        if node is None:
            heal(self.client)  # (no master known for the slot: the map has a gap)
            return
        if silent(exc):
            with self._lock:
                self.last_missed = node.name
                self._missed.add(node.name)
                probed = node.name in self._down
                self._down.add(node.name)
            if not probed:
                log.warning("master %s does not answer: its partitions are passed over until it does (%s)",
                            node.name, exc)
                threading.Thread(target=self._probe, args=(node,), name=f"probe {node.name}", daemon=True).start()
        heal(self.client, node.name)

    def _probe(self, node: Any) -> None:
        """Until the master answers a PING, or the slot map (read again every HEAL_S) names it a master no more."""
        healed = time.monotonic()
        while True:
            time.sleep(PROBE_S)
            try:
                self.client.get_redis_connection(node).ping()
                with self._lock:  # (answering: read again, its lost replies looked for, in that order)
                    self._down.discard(node.name)
                self.answered(node)
                return
            except Exception:  # noqa: BLE001 - anything but an answer: probed again
                if time.monotonic() - healed < HEAL_S:
                    continue
                healed = time.monotonic()
                heal(self.client, node.name)
                try:
                    if all(n.name != node.name for n in self.client.get_primaries()):
                        break  # (its slots are read where they are now)
                except Exception:  # noqa: BLE001 - no map: probed again
                    pass
        with self._lock:
            self._down.discard(node.name)
            self.back_at = time.monotonic()

    def failed_key(self, key: str, exc: BaseException) -> None:
        """As `fail`, for the master of the key's slot."""
        self.fail(self.node(key), exc)
