"""A Redis Cluster's masters as a consumer of every partition sees them: which master holds each partition's slot,
and which of them did not answer a moment ago (dead, paused, cut off, failing over).

A consumer of every partition (a tokenizer's read, an inference worker's pop, their upkeep) sends each master's
share of a call in a plain pipeline of its own, on a client that does not retry and waits FAST_TIMEOUT_S at most
for a reply, and passes over the partitions of a master that did not answer for DOWN_S (REFUSED_S where it refused
the connection: a dead one); then tries it again. The slot map
is read again after each failure, so once a replica holds those slots its partitions are read there (another node:
not marked). One master's outage holds back its own partitions' jobs, not every partition's, and none for longer
than its own outage. On a single Redis every key has the one node, and nothing is passed over.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import redis
from redis.exceptions import AskError, MovedError

from shared.redis_client import CLUSTER_TYPES, RETRYABLE, heal, is_cluster, sync_client

log = logging.getLogger(__name__)

K = TypeVar("K")
DOWN_S = 2.0  # a master that did not answer in time is passed over this long, then tried again
REFUSED_S = 0.25  # one that refused the connection (dead: a try costs nothing) this long
FAST_TIMEOUT_S = 1.0  # how long the fail-fast client waits for a reply (a silent master costs this once per DOWN_S)
# what says a master does not answer (its connection failed or timed out): passed over; a refusal (OOM, NOREPLICAS,
# TRYAGAIN) is answered at once, and only read again
SILENT = (redis.ConnectionError, redis.TimeoutError, OSError)
REDIRECTED = (MovedError, AskError)  # a reply from a master the slot left (a failover): the map is read again


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
        self._down: dict[str, float] = {}  # master (host:port) -> until when it is passed over
        # masters that did not answer a call since they last did: its command may have run all the same, once the
        # master went on, its reply gone with the connection (a read, a pop: entries now pending for their caller)
        self._missed: set[str] = set()
        self._back: set[str] = set()  # of those, the ones that answered since (`take_back`)
        self.last_missed: str | None = None  # the master that missed a call last: asked last for the slot map

    def node(self, key: str) -> Any:
        """The master of the key's slot in the client's map (None: a single Redis, or none known)."""
        if not self.cluster:
            return None
        try:
            return self.client.get_node_from_key(key)
        except (redis.RedisError, *RETRYABLE):
            return None

    def is_down(self, key: str) -> bool:
        """Whether the master of the key's slot failed less than DOWN_S ago."""
        node = self.node(key)
        return node is not None and self._down.get(node.name, 0.0) > time.monotonic()

    def groups(self, items: Iterable[K], key: Callable[[K], str]) -> list[tuple[Any, list[K]]]:
        """The items by the master of their key's slot, in their order within each, those of a master that is
        down left out (one group, node None, on a single Redis)."""
        if not self.cluster:
            return [(None, list(items))]
        out: dict[str, tuple[Any, list[K]]] = {}
        now = time.monotonic()
        for item in items:
            node = self.node(key(item))
            if node is None:
                continue  # (no map: read again by the next failure's heal)
            if self._down.get(node.name, 0.0) > now:
                continue
            out.setdefault(node.name, (node, []))[1].append(item)
        return list(out.values())

    def send(self, node: Any, fill: Callable[[Any], None]) -> list[Any] | None:
        """The commands `fill` queues, in one plain pipeline to `node` (the client's own on a single Redis): their
        replies, errors as exceptions (a redirection among them: the slot map is read again); None when the master
        did not answer (passed over, the slot map read again). A single Redis's failure raises, as any call's."""
        pipe = self.client.pipeline(transaction=False) if node is None else \
            self.client.get_redis_connection(node).pipeline(transaction=False)
        fill(pipe)
        if node is None:
            return list(pipe.execute(raise_on_error=False))
        try:
            replies = list(pipe.execute(raise_on_error=False))
        except RETRYABLE as exc:
            self.fail(node, exc)
            return None
        self.answered(node)
        if any(isinstance(r, REDIRECTED) for r in replies):
            heal(self.client)
        return replies

    def answered(self, node: Any) -> None:
        """The master answered a call."""
        if node is not None and node.name in self._missed:
            log.info("master %s answers again", node.name)
            self._missed.discard(node.name)
            self._back.add(node.name)

    def take_back(self) -> set[str]:
        """The masters that answered again since they missed a call (each once): their calls' lost replies are to
        be looked for (`StreamConsumer.lost`)."""
        back, self._back = self._back, set()
        return back

    def fail(self, node: Any, exc: BaseException) -> None:
        """After a failed call to the master: pass it over where it did not answer (SILENT: DOWN_S, or REFUSED_S
        where it refused the connection), and read the slot map again."""
        if node is None:
            return
        if isinstance(exc, SILENT):
            if node.name not in self._missed:
                log.warning("master %s does not answer: its partitions are passed over until it does (%s)",
                            node.name, exc)
            timed_out = isinstance(exc, (redis.TimeoutError, TimeoutError))
            self._down[node.name] = time.monotonic() + (DOWN_S if timed_out else REFUSED_S)
            self._missed.add(node.name)
            self.last_missed = node.name
        heal(self.client, node.name)

    def failed_key(self, key: str, exc: BaseException) -> None:
        """As `fail`, for the master of the key's slot."""
        self.fail(self.node(key), exc)
