"""A fence: how a writer on a Redis Cluster learns that a replica has what a master answered it, when its writes
went through a cluster pipeline (which sends a failed command again on its own, on another connection) and
cannot carry their own WAIT. The output lane's fencer (gpu_worker/fencer.py) waits for it before a job that ended
is reported Done (and its stream entry acknowledged): an end that a failover could still undo would leave a job
running that no worker holds. The batch driver's end of a batch waits for it before the batch leaves the drivers'
set, and the tenants CLI before it says a key was created or revoked.

Per master that serves one of the given keys, a write to a fence key in that key's slot (`names.fence_key`) and
WAIT 1, together on one connection to it. A master copies its writes in the order it ran them, so a copied fence
covers every write it answered before. The fence is a write of its own because WAIT answers for its connection's
last write: on a connection that wrote nothing it answers at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import redis
import redis.cluster

from shared import names
from shared.job_ops import REPLICA_WAIT_MS, NotCopied
from shared.redis_client import RETRYABLE, heal

log = logging.getLogger(__name__)

FENCE_TTL_MS = 60_000  # a fence key lives this long after its last write
ALONE_RECHECK_S = 5.0  # a master found without a replica is not waited on for this long, then asked again
# a master that still serves its slots and lists a replica that has not confirmed for this long (lagging, paused, cut
# off but not yet failed by the cluster) is taken to have none: its writers wait this long, not for as long as the
# lag lasts (a worker's output would stall with them)
LAGGING_S = 5.0


class Fence:
    """A writer's fences, and what it learnt of masters that could not confirm (by master: as many as the cluster
    has)."""

    def __init__(self, client: redis.cluster.RedisCluster) -> None:
        self.client = client
        self.alone: dict[str, float] = {}  # master -> until when it is taken to have no replica
        self.unconfirmed: dict[str, float] = {}  # master -> since when its replica has not confirmed

    def confirm(self, keys: Iterable[str]) -> None:
        """Return once a replica has every write that the masters of `keys` answered so far. Raises
        NotCopied (retryable) when one did not confirm within REPLICA_WAIT_MS while its slot map (read again)
        still lists a replica, or the fence met a node that no longer serves its slot: the caller sends its writes
        again (replays where they stood; a failover's promoted replica may lack them) and confirms again. A master
        that the cluster lists without a replica (its replica failed, or never synced), or whose listed replica has
        not confirmed for LAGGING_S, cannot confirm: its writes stand as they are, with a warning, and it is asked
        again after ALONE_RECHECK_S. A master with no replica connected (killed, restarting: ROLE lists none) is
        taken to have none at its first unconfirmed WAIT, and is asked with ROLE, not WAIT, until one is connected
        again. A failed connection raises its own (retryable) error."""
        now = time.monotonic()
        for node, fence, _ in self._masters(keys).values():
            self._confirm(node, fence, now)

    def not_copied(self, keys: Iterable[str]) -> list[str]:
        """`confirm`, master by master, answering rather than raising: the keys whose masters did not confirm
        (NotCopied, or a failed connection). The masters that confirmed last time go first, so that a lagging
        replica's WAIT does not hold up the others'."""
        now = time.monotonic()
        keys = list(keys)
        masters = self._masters(keys)
        served_by_one = {key for _, _, served in masters.values() for key in served}
        failed = [key for key in keys if key not in served_by_one]  # in a slot the map has no master for
        for name in sorted(masters, key=lambda n: n in self.unconfirmed):
            node, fence, served = masters[name]
            try:
                self._confirm(node, fence, now)
            except RETRYABLE as exc:
                log.debug("master %s did not confirm: %s", name, exc)
                if not isinstance(exc, NotCopied):
                    heal(self.client)  # a node that failed: the slot map read again before the next fence
                failed += served
        return failed

    def _confirm(self, node: Any, fence: str, now: float) -> None:
        """One master's part of `confirm`."""
        if self.alone.get(node.name, 0.0) > now:
            return
        conn = self.client.get_redis_connection(node)
        if node.name in self.alone and not _replicas(conn):  # asked again, and still none: no WAIT's second
            self.alone[node.name] = now + ALONE_RECHECK_S
            return
        pipe = conn.pipeline(transaction=False)
        pipe.set(fence, 1, px=FENCE_TTL_MS)
        pipe.execute_command("WAIT", 1, REPLICA_WAIT_MS)
        wrote, copies = pipe.execute(raise_on_error=False)
        if isinstance(wrote, Exception) or isinstance(copies, Exception):
            heal(self.client)
            raise NotCopied(f"the writes on {node.name} ({wrote if isinstance(wrote, Exception) else copies})")
        if int(copies) >= 1:
            self.alone.pop(node.name, None)
            self.unconfirmed.pop(node.name, None)
            return
        # how long its replica has not confirmed, up to this answer (reading the slot map again, next, can take
        # seconds of its own: a paused node answers nothing until the read times out)
        answered = time.monotonic()
        lagging_s = answered - self.unconfirmed.setdefault(node.name, answered)
        if not _replicas(conn):  # none connected (killed, restarting): none will confirm, however long it waits
            log.warning("master %s has no replica connected: the writes there go on without a copy", node.name)
            self.alone[node.name] = now + ALONE_RECHECK_S
            return
        heal(self.client)  # the cluster's view now: a failed replica is no longer listed
        serving = [n.name for n in self.client.nodes_manager.slots_cache.get(self.client.keyslot(fence)) or []]
        if not serving or serving[0] != node.name:
            raise NotCopied(f"the writes on {node.name}")  # served elsewhere now: written again there
        if len(serving) > 1 and lagging_s < LAGGING_S:
            raise NotCopied(f"the writes on {node.name}")
        log.warning("master %s has %s: the writes there go on without a copy", node.name,
                    "no replica" if len(serving) == 1 else f"no replica that confirmed for {LAGGING_S:g} s")
        self.alone[node.name] = now + ALONE_RECHECK_S

    def _masters(self, keys: Iterable[str]) -> dict[str, tuple[Any, str, list[str]]]:
        """Per master serving one of `keys` (by the slot map as it is), the node, a fence in the first such key's
        slot, and the keys it serves."""
        out: dict[str, tuple[Any, str, list[str]]] = {}
        for key in keys:
            fence = names.fence_key(key)
            node = self.client.get_node_from_key(fence)
            if node is not None:
                out.setdefault(node.name, (node, fence, []))[2].append(key)
        return out


def _replicas(conn: redis.Redis) -> int:
    """How many replicas a master has connected (ROLE); on an error, taken to have one (the caller waits on it as
    the cluster lists it)."""
    try:
        role = conn.execute_command("ROLE")
    except redis.RedisError:
        return 1
    return len(role[2]) if role and role[0] in (b"master", "master") else 1
