"""The output lane's writes, partition by partition, and those waiting for their partition (a Redis Cluster's).

A step's writes are cut into one `Unit` per partition: the prompts' logprob documents, the step call, then the
finishes of that partition's jobs (one slot: one master). On a cluster, `send` sends the units in one pipeline per
master and answers which went through and which met an outage (a master down, paused, failing over, refusing
writes). A unit that met one waits in the `Backlog`, and so does every later unit of its partition, in order: a
thread of its own sends them again until they go through, while the lane writes every other partition's steps as
they come. One master's outage holds only the streams of its own partitions; the output lane reads each unit's
replies on its own loop once it is written (`OutputLane.settle`), in the order they were built. A job's end that a
replica did not confirm is sent again the same way, with its last writes (`OutputLane.refence`): whatever a master
that does not answer holds up, it is never the lane's loop.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from redis.exceptions import AskError

from shared.jobs import FinishReason
from shared.redis_client import RETRYABLE, heal
from shared.redis_errors import refused
from shared.retry import Backoff
from shared.scripts.codes import FinishCode, StepCode, StepReply

log = logging.getLogger("conveyor.output_lane")

# a reply that says the call was not run: an outage (shared/redis_client.py), or a slot that moved (the unit is sent
# again once the slot map is read again)
UNWRITTEN = (*RETRYABLE, AskError)
BEHIND_REPLAYS = 3  # a unit sent again for a finish that ran before its step, at most; then: its record lost steps
# a partition's first held unit is sent again at most this far apart: the streams it holds resume at most this long
# after its master takes writes again
RETRY_CAP_S = 0.25
HELD_UNITS = 4096  # units waiting at most (a few KB each): past it the lane waits for its backlog, as for any outage

# an ending job's finish: (job, reason, error, fields, worker, owner, its last step's (chunk seq, tokens written))
Ending = tuple[str, FinishReason, str, dict[str, Any], str, str, tuple[int, int]]
Calls = list[tuple[Any, dict[str, Any]]]  # a pipeline's commands: (args, options)


@dataclass
class Unit:
    """One partition's writes of one step, and where their replies are."""

    partition: int
    key: str  # a key of its partition's slot: which master holds it
    calls: Calls
    first_step: int  # replies before the step call's (the prompts' logprob documents)
    steps: list[list[str]]  # per step call (one, or none: only ends), its jobs in their order
    ends: list[Ending]  # the finishes that follow the step call, in order
    done: list[str]  # the jobs ending in it, reported Done once written: settle takes dropped ones out
    behind: int = 0  # times it was sent again for a finish that ran before its step
    again: bool = False  # a job's end sent again, with its last writes (`OutputLane.refence`)

    @property
    def finishes(self) -> list[str]:
        """The jobs whose finish follows the step call, in order."""
        return [end[0] for end in self.ends]


def behind(unit: Unit, results: list[Any]) -> bool:
    """Whether a finish answered behind while its job's step went through (not refused as a gap: that job fails):
    the step failed and was sent again after the finish (a cluster client resends a pipeline's failed commands one
    at a time), or reached a node that lacks it. The step replies are read only when a finish is behind (rare)."""
    at = unit.first_step + len(unit.steps)
    late = {job_id for job_id, raw in zip(unit.finishes, results[at:])
            if not isinstance(raw, Exception) and int(raw) == FinishCode.behind}
    for i, job_ids in enumerate(unit.steps if late else ()):
        raw = results[unit.first_step + i]
        if not isinstance(raw, Exception):
            late.difference_update(j for j, code in zip(job_ids, StepReply.parse(raw).codes) if code is StepCode.gap)
    return bool(late)


def send(units: list[Unit], client: Any, down: set[str] | None = None) -> tuple[list[tuple[Unit, list[Any]]],
                                                                          list[Unit]]:
    """The units' calls on a cluster, in one pipeline per master that holds their partitions now (in order within
    each, straight to the node: a redirection or a failed connection is not followed up here, one command at a time,
    but answered): (the units written, with their replies), and the units that met an outage (a connection failed or
    timed out, a reply is retryable, the slot moved). `down`: masters found not answering (a connection failed or
    timed out), added to; their units are not sent. A unit whose finish came before its step is sent again,
    BEHIND_REPLAYS times at most."""
    written: list[tuple[Unit, list[Any]]] = []
    failed: list[Unit] = []
    todo = units
    while todo:
        groups: dict[str, tuple[Any, list[Unit]]] = {}
        for unit in todo:
            node = _node(client, unit.key)
            if node is None or (down is not None and node.name in down):
                failed.append(unit)
            else:
                groups.setdefault(node.name, (node, []))[1].append(unit)
        todo = []
        for node, group in groups.values():
            try:
                pipe = client.get_redis_connection(node).pipeline(transaction=False)
                for unit in group:
                    for args, options in unit.calls:
                        pipe.pipeline_execute_command(*args, **options)
                results = pipe.execute(raise_on_error=False)
            except RETRYABLE:
                if down is not None:
                    down.add(node.name)
                failed += group
                continue
            at = 0
            for unit in group:
                replies, at = results[at:at + len(unit.calls)], at + len(unit.calls)
                # (a script refused at its first write names the refusal only in its text)
                replies = [refused(r) if isinstance(r, redis.ResponseError) else r for r in replies]
                if any(isinstance(r, UNWRITTEN) for r in replies):
                    failed.append(unit)
                elif unit.behind < BEHIND_REPLAYS and behind(unit, replies):
                    unit.behind += 1
                    todo.append(unit)
                else:
                    written.append((unit, replies))
    return written, failed


def _node(client: Any, key: str) -> Any:
    """The master that holds the key's slot in the client's map (None: none known)."""
    try:
        return client.get_node_from_key(key)
    except (redis.RedisError, *RETRYABLE):
        return None


class Backlog:
    """The units of the partitions whose writes met an outage, in order, sent again by a thread of its own (with
    a cluster client of its own) until they go through. The lane hands each new unit of a held partition here
    (`hold`), and takes back the units written, with their replies, in the order they were built."""

    def __init__(self, client: Any, on_outage: Callable[[], None], on_back: Callable[[list[int]], None]) -> None:
        self.client = client
        self.on_outage = on_outage  # called from this thread after a failed send
        self.on_back = on_back  # with the partitions that met an outage and have nothing held now
        self._lock = threading.Condition()
        self._held: dict[int, deque[Unit]] = {}
        self._written: list[tuple[Unit, list[Any]]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="backlog", daemon=True)
        self._thread.start()

    def hold(self, units: list[Unit]) -> tuple[list[Unit], list[tuple[Unit, list[Any]]]]:
        """The units whose partitions hold nothing (the rest join their partition's backlog), and the units written
        since the last call, with their replies: read those first (a partition no longer held has every unit of
        it among them)."""
        with self._lock:
            written, self._written = self._written, []
            ready = []
            for unit in units:
                queue = self._held.get(unit.partition)
                if queue is None:
                    ready.append(unit)
                else:
                    queue.append(unit)
            return ready, written

    def add(self, units: list[Unit]) -> None:
        """Units to send from this thread, each after the units of its partition waiting here: those that met an
        outage (each the first of its partition: held from now on), and jobs' ends sent again."""
        with self._lock:
            for unit in units:
                self._held.setdefault(unit.partition, deque()).append(unit)
            self._lock.notify_all()

    def holds(self, partition: int) -> bool:
        with self._lock:
            return partition in self._held

    def busy(self) -> bool:
        """Whether units wait here, or written ones wait to be read."""
        with self._lock:
            return bool(self._held or self._written)

    def wait_room(self) -> None:
        """Until fewer than HELD_UNITS units wait: the lane's loop stops taking steps while it waits."""
        with self._lock:
            while sum(map(len, self._held.values())) >= HELD_UNITS and not self._stop:
                self._lock.wait(1.0)

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
            left = sum(map(len, self._held.values()))
        if left:  # their jobs' entries stay pending: another worker resumes them from their records
            log.warning("%d held output writes not sent at exit", left)
        self._thread.join(timeout=1)
        self.client.close()

    def _run(self) -> None:
        backoff = Backoff(0.05, RETRY_CAP_S)
        failing: set[int] = set()  # the partitions whose last send failed
        hit: set[int] = set()  # the partitions held that met an outage since
        while True:
            with self._lock:
                while not self._held and not self._stop:
                    self._lock.wait()
                if self._stop:
                    return
                # the partitions whose last send went through first, then a probe of each other one (its first unit
                # only: the others would only find their jobs' records behind it); once that goes through, the rest
                rounds = [[u for p, q in self._held.items() if p not in failing for u in q],
                          [q[0] for p, q in self._held.items() if p in failing]]
            failed: list[Unit] = []
            for todo in filter(None, rounds):
                failed += self._send(todo)
            failing = {unit.partition for unit in failed}
            hit |= failing
            with self._lock:
                back = [p for p in hit if p not in self._held]
            if back:
                hit.difference_update(back)
                self.on_back(back)
            if failed:
                self.on_outage()
                heal(self.client)
                with self._lock:
                    if not self._stop:
                        self._lock.wait(backoff.next())
            else:
                backoff.reset()

    def _send(self, todo: list[Unit]) -> list[Unit]:
        """Send units (each partition's in order), hand those written back, in order, none of a partition past
        one that failed; the units that failed."""
        try:
            written, failed = send(todo, self.client)
        except Exception:  # noqa: BLE001 - the thread goes on: the units are sent again
            log.exception("held output writes could not be sent")
            written, failed = [], todo
        replies = {id(unit): res for unit, res in written}
        with self._lock:
            for partition in {unit.partition for unit in todo}:
                queue = self._held[partition]
                while queue and id(queue[0]) in replies:  # in order: none past one that failed
                    unit = queue.popleft()
                    self._written.append((unit, replies[id(unit)]))
                if not queue:
                    del self._held[partition]
                    log.info("the held output writes of partition %d went through", partition)
            self._lock.notify_all()
        return failed
