"""At-least-once consumption of a Redis stream by a consumer group (or of one stream per partition:
the same group on each; see shared/names.py).

New entries come from XREADGROUP; entries a dead consumer (not a live worker of its pool, as
shared.signals reads the pool's registry) left pending are taken over with XCLAIM once idle past a
deadline. A live consumer keeps its own in-flight entries fresh (XCLAIM ... JUSTID resets their
idle time) so long generations are not stolen. An entry delivered more than `delivery_limit` times
goes to the dead-letter stream instead. Entries already delivered twice are claimed one at a time,
so a poison entry reaches the dead-letter stream alone (its partition's).

With several streams, a read on one Redis node is one XREADGROUP over all of them; on a cluster
(one slot per call) it is one non-blocking read per stream, in a pipeline per master; when all were empty, the
reads of the partitions whose ring flag it sets again, each after its flag, then a wait on the ring
(shared/ring.py). Entries carry their stream; acknowledgements and claims go to it.

On a cluster the reads, the pending lists and the refreshes go master by master (shared/masters.py): the streams
of a master that does not answer are passed over for a moment, and the others' are read, claimed and kept fresh
meanwhile (their entries wait for nobody's failover). Given a fail-fast client (`fast`), a silent master holds a
call FAST_TIMEOUT_S at most.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict, cast

import redis

from shared import names
from shared.masters import REDIRECTED, Masters
from shared.redis_client import CLUSTER_TYPES, RETRYABLE, heal, text
from shared.ring import Ring
from shared.signals import parse_registry

if TYPE_CHECKING:
    from redis.typing import EncodableT, FieldT, StreamIdT, XReadGroupResponse

log = logging.getLogger(__name__)

Fields = dict[bytes | str, bytes | str]
Ref = tuple[str, str]  # (stream, entry id): what acknowledgements and claims name
# Replies as the clients here read them: RESP2, redis-py's default (its types cover RESP3's forms too)
ReadReply = list[tuple[bytes | str, list[tuple[bytes | str, Fields | None]]]]  # XREADGROUP: per stream, its entries
ClaimReply = list[tuple[bytes | str, Fields | None]]  # XCLAIM without JUSTID: fields None for an entry trimmed since
IDLE_WAIT_S = 1.0  # on a cluster, a read that may block for ever waits on its ring this long at a time
LOST_COUNT = 1024  # a stream's own pending entries read back at most, after its master missed a call (`lost`)
RETRY_PAGES = 16  # pages of a consumer's own pending entries looked through for those due again (`retry_own`)


@dataclass
class Entry:
    id: str
    fields: Fields
    deliveries: int = 1
    stream: str = ""

    @property
    def ref(self) -> Ref:
        return self.stream, self.id


class Pending(TypedDict):
    """A row of XPENDING's extended form, as redis-py parses it."""
    message_id: bytes | str
    consumer: bytes | str
    time_since_delivered: int
    times_delivered: int


class StreamConsumer:
    # what ends the work of an entry past the delivery limit (its job failed), run before the entry is dead-lettered
    # (acknowledged): when it raises, the entry stays pending, and the next claim runs it again
    on_dead: Callable[[Entry], None] | None = None

    def __init__(self, client: redis.Redis, streams: str | list[str], group: str, consumer: str, pool: str,
                 claim_idle_ms: int = 30_000, delivery_limit: int = 3, fast: redis.Redis | None = None) -> None:
        self.client, self.group, self.consumer = client, group, consumer
        # the masters (a cluster's) that the reads, pending lists and refreshes go to one by one; on `fast`, a
        # client that does not retry and waits briefly, where given
        self.masters = Masters(fast if fast is not None else client)
        self.streams = [streams] if isinstance(streams, str) else list(streams)
        self.pool = pool  # consumers are workers of this pool; its registry says who is alive
        self.claim_idle_ms, self.delivery_limit = claim_idle_ms, delivery_limit
        self.cluster = isinstance(client, CLUSTER_TYPES)
        self._quiet_until = 0.0
        self._turn = 0
        # on a cluster, the flag of each stream's partition for this group, and the ring they name
        self._flags = {s: names.ring_key(names.stream_partition(s), group, names.stream_model(s)) for s in self.streams}
        self.ring = Ring(client, sorted(set(self._flags.values())),
                         names.ring_channel(group, names.stream_model(self.streams[0])))

    def ensure_group(self) -> None:
        for stream in self.streams:
            try:
                self.client.xgroup_create(stream, self.group, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def read(self, count: int, block_ms: int | None) -> list[Entry]:
        """New entries; block_ms None returns at once, 0 would wait forever."""
        try:
            if not self.cluster or len(self.streams) == 1:
                return self._entries(self.client.xreadgroup(self.group, self.consumer, dict.fromkeys(self.streams, ">"),
                                                            count=count, block=block_ms))
            entries = self._sweep(count)
            if entries or block_ms is None:
                return entries
            if self.ring.listen() and (arm := set(self.ring.to_arm())):
                entries = self._sweep(count, arm)
                if entries:
                    return entries
            return self._sweep(count) if self.ring.wait(block_ms / 1000 or IDLE_WAIT_S) else []
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self.ensure_group()  # a stream was deleted (or Redis lost its data): start over
            return []

    def _sweep(self, count: int, arm: set[str] | None = None) -> list[Entry]:
        """One non-blocking read per stream, starting at the next in turn, in a pipeline per master (those down
        passed over); with `arm`, only the streams of those ring flags, each flag set before its partition's first
        read (on the same master's connection, so in that order)."""
        self._turn = (self._turn + 1) % len(self.streams)
        unset = set(arm or ())
        order = [s for s in self.streams[self._turn:] + self.streams[:self._turn]
                 if arm is None or self._flags[s] in arm]

        def read(pipe: Any, stream: str) -> None:
            flag = self._flags[stream]
            if flag in unset:
                unset.discard(flag)
                self.ring.arm(pipe, flag)
            pipe.xreadgroup(self.group, self.consumer, {stream: ">"}, count=count)

        replies = self._each_master(order, read)
        if arm is None and not replies:
            raise redis.ConnectionError("no master of the streams answers")
        entries = [e for reply in replies.values() if not isinstance(reply, Exception) for e in self._entries(reply)]
        errors = [reply for reply in replies.values() if isinstance(reply, Exception)]
        # a stream whose master could not answer (refusing writes; or not at all: no reply) is read next time: the
        # entries read from the others are answered (they are this consumer's now; raising would strand them until
        # they idle out), its error raised only when no stream answered
        if any("NOGROUP" in str(e) for e in errors) and not entries:
            self.ensure_group()  # a stream was deleted (or Redis lost its data): its group made again
        elif errors and len(errors) == len(replies):
            raise errors[0]
        return entries

    def _each_master(self, streams: list[str], queue: Callable[[Any, str], None]) -> dict[str, Any]:
        """Per stream, the reply of the last command `queue` puts on a pipeline for it, in one pipeline per master
        (a single Redis's: one): errors as exceptions. The streams of a master that is down, or that does not
        answer now, have no reply (shared/masters.py); a single Redis's failure raises."""
        out: dict[str, Any] = {}
        for node, group in self.masters.groups(streams, key=lambda s: s):
            ends: list[int] = []  # per stream, the position of its last command's reply

            def fill(pipe: Any, group: list[str] = group, ends: list[int] = ends) -> None:
                for stream in group:
                    queue(pipe, stream)
                    ends.append(len(pipe.command_stack) - 1)
            replies = self.masters.send(node, fill)
            if replies is not None:  # (a stream whose slot moved is read where it is now, next time)
                out.update((stream, replies[at]) for stream, at in zip(group, ends)
                           if not isinstance(replies[at], REDIRECTED))
        return out

    def lost(self, known: Container[Ref] = ()) -> list[Entry]:
        """This consumer's own pending entries in the streams of masters that answer again after missing a call
        (shared/masters.py), those in `known` (held or worked on already) left out: a read or a pop that timed out
        may have run all the same once its master went on, and its entries are pending here, their reply gone
        with the connection. Listed by XPENDING and read by XRANGE, which leave their delivery counts alone (a
        read of this consumer's history, XREADGROUP from 0, would count one more delivery of each, the running
        ones' too). A master whose list or entries were not all read is looked for again next time."""
        back = self.masters.take_back()
        if not back:
            return []
        streams = [s for s in self.streams if (node := self.masters.node(s)) is not None and node.name in back]
        listed = self._each_master(streams, lambda pipe, stream: pipe.xpending_range(
            stream, self.group, min="-", max="+", count=LOST_COUNT, consumername=self.consumer))
        wanted = {s: [r for r in cast(list[Pending], rows) if (s, text(r["message_id"])) not in known]
                  for s, rows in listed.items() if not isinstance(rows, Exception)}
        entries: list[Entry] = []
        read = {s for s, rows in wanted.items() if not rows}
        for node, group in self.masters.groups([s for s, rows in wanted.items() if rows], key=lambda s: s):
            asked: list[tuple[str, Pending]] = []

            def fill(pipe: Any, group: list[str] = group, asked: list[tuple[str, Pending]] = asked) -> None:
                asked.clear()
                for stream in group:
                    for row in wanted[stream]:
                        eid = text(row["message_id"])
                        pipe.xrange(stream, eid, eid)
                        asked.append((stream, row))
            replies = self.masters.send(node, fill)
            if replies is None:
                continue
            failed = {stream for (stream, _), reply in zip(asked, replies) if isinstance(reply, Exception)}
            read.update(set(group) - failed)
            entries += [Entry(text(reply[0][0]), reply[0][1], int(row["times_delivered"]), stream)
                        for (stream, row), reply in zip(asked, replies)
                        if stream not in failed and reply]  # (an entry deleted since: nothing to take)
        self.masters.look_again({node.name for s in streams if s not in read
                                 and (node := self.masters.node(s)) is not None})
        return entries

    @staticmethod
    def _entries(reply: XReadGroupResponse | None) -> list[Entry]:
        return [Entry(text(eid), fields, 1, text(stream)) for stream, items in cast(ReadReply, reply or [])
                for eid, fields in items if fields is not None]

    def _pending(self, count: int, idle_ms: int, consumer: str | None = None, streams: list[str] | None = None,
                 after: dict[str, str] | None = None) -> list[tuple[str, Pending]]:
        """Each stream's (of `streams`, default all) entries of the group pending for idle_ms or more (of `consumer`
        only, where given; past the id `after` names for it, where given), up to `count` a stream; a stream whose
        master does not answer now has none (it is asked again next time)."""
        after = after or {}
        replies = self._each_master(self.streams if streams is None else streams, lambda pipe, stream: (
            pipe.xpending_range(stream, self.group, min=f"({after[stream]}" if stream in after else "-", max="+",
                                count=count, consumername=consumer, idle=idle_ms)))
        rows: list[tuple[str, Pending]] = []
        for stream, reply in replies.items():
            if isinstance(reply, Exception):
                if "NOGROUP" not in str(reply):
                    raise reply
                self.ensure_group()
                continue
            rows += [(stream, r) for r in cast(list[Pending], reply)]
        return rows

    def note_outage(self) -> None:
        """After losing Redis, live owners need time to refresh their entries and heartbeats
        before anything idle can be taken for a dead consumer's. A cluster client's next try goes by a
        fresh slot map."""
        self._quiet_until = time.monotonic() + self.claim_idle_ms / 1000
        heal(self.client, self.masters.last_missed)  # (a master that stopped answering asked last)

    def claim_stale(self, count: int = 64) -> tuple[list[Entry], list[Entry]]:
        """Take over entries idle past the deadline whose consumer is not a live worker of the pool.
        Returns (to process, dead-lettered)."""
        if time.monotonic() < max(self._quiet_until, self.masters.back_at + self.claim_idle_ms / 1000):
            return [], []  # (after an outage, or a master's: live owners refresh their entries and heartbeats)
        holders = self._holders()
        owners = set().union(*holders.values()) - {self.consumer}
        if not owners:
            return [], []
        live = self._live()
        if live is None:
            return [], []  # (who is alive cannot be told now: nothing is taken for a dead consumer's)
        stale: list[tuple[str, Pending]] = []
        for owner in sorted(owners - live):  # each dead consumer's own entries (however many a live one holds)
            stale += self._pending(count - len(stale), self.claim_idle_ms, owner,
                                   [s for s, held in holders.items() if owner in held])
            if len(stale) >= count:
                break
        if not stale:
            return [], []
        # an entry delivered twice already may be what killed its workers: take such entries one
        # at a time, so one that kills again takes no other entry's delivery count with it
        suspects = [(s, r) for s, r in stale if int(r["times_delivered"]) >= 2]
        if suspects:
            stale = suspects[:1]
        # XCLAIM re-checks the idle time, so two workers claiming at once cannot both win
        return self._claim(stale, self.claim_idle_ms)

    def _holders(self) -> dict[str, set[str]]:
        """Per stream, the consumers that hold pending entries (XPENDING's summary; a stream whose master does not
        answer now: none)."""
        out: dict[str, set[str]] = {}
        for stream, reply in self._each_master(self.streams, lambda pipe, stream: pipe.xpending(
                stream, self.group)).items():
            if isinstance(reply, Exception):
                if "NOGROUP" not in str(reply):
                    raise reply
                self.ensure_group()
                continue
            out[stream] = {text(c["name"]) for c in reply.get("consumers") or () if int(c["pending"])}
        return out

    def _live(self) -> set[str] | None:
        """The pool's live workers, read on the masters' client; None while the registry's master does not
        answer (a cluster's: passed over, as a stream's)."""
        registry = names.workers_key(self.pool)
        if self.masters.is_down(registry):
            return None
        try:
            pipe = self.masters.pipeline(registry)
            pipe.zrange(registry, 0, -1, withscores=True)
            reply = pipe.execute()[0]
        except (*RETRYABLE, *REDIRECTED) as exc:
            if not self.masters.cluster:
                raise
            self.masters.failed_key(registry, exc)
            return None
        return set(parse_registry(reply, time.time()))

    def retry_own(self, idle_ms: int, count: int = 64,
                  due_ms: Callable[[int], int] | None = None) -> tuple[list[Entry], list[Entry]]:
        """Take back this consumer's own entries left pending (unacknowledged: their work failed)
        for idle_ms or more (`due_ms(deliveries so far)`, where given: a backoff), for another try. Returns (to
        process, dead-lettered)."""
        if due_ms is None:
            own = self._pending(count, idle_ms, self.consumer)
            return self._claim(own, idle_ms) if own else ([], [])
        # the due among them, listed page after page: entries backed off for long, the oldest, must not hide
        # one due now behind them
        rows: list[tuple[str, Pending]] = []
        after: dict[str, str] = {}
        streams = list(self.streams)
        for _ in range(RETRY_PAGES):
            page = self._pending(count, idle_ms, self.consumer, streams, after)
            rows += [(s, r) for s, r in page if int(r["time_since_delivered"]) >= due_ms(int(r["times_delivered"]))]
            listed = Counter(s for s, _ in page)
            full = {s for s, n in listed.items() if n == count}  # streams with more to list
            after.update((s, text(r["message_id"])) for s, r in page)
            streams = [s for s in streams if s in full]
            if len(rows) >= count or not streams:
                break
        return self._claim(rows[:count], idle_ms) if rows else ([], [])

    def _claim(self, rows: list[tuple[str, Pending]], idle_ms: int) -> tuple[list[Entry], list[Entry]]:
        """XCLAIM the pending `rows` (stream, row) still idle for idle_ms; acknowledge entries trimmed
        meanwhile and dead-letter those past the delivery limit, each once `on_dead` ended its work. Returns
        (to process, dead-lettered)."""
        keep: list[Entry] = []
        dead: list[Entry] = []
        for stream, ids in _by_stream((s, text(r["message_id"])) for s, r in rows).items():
            deliveries = {text(r["message_id"]): int(r["times_delivered"]) + 1 for s, r in rows if s == stream}
            claimed = cast(ClaimReply, self.client.xclaim(stream, self.group, self.consumer, idle_ms, ids))
            self.ack([(stream, text(eid)) for eid, fields in claimed if fields is None])
            for eid, fields in claimed:
                if fields is not None:
                    entry = Entry(text(eid), fields, deliveries.get(text(eid), 1), stream)
                    (dead if entry.deliveries > self.delivery_limit else keep).append(entry)
        for entry in dead:
            if self.on_dead is not None:
                self.on_dead(entry)
            # (its count takes in this claim, whose delivery it never gets)
            self.dead_letter(entry, f"delivered {entry.deliveries - 1} times without completing")
        return keep, dead

    def refresh(self, refs: list[Ref]) -> None:
        """Reset the idle time of entries this consumer still works on (those of a master that does not answer
        now next time: nobody can take them there meanwhile)."""
        ids = _by_stream(refs)
        replies = self._each_master(list(ids), lambda pipe, stream: pipe.xclaim(
            stream, self.group, self.consumer, 0, ids[stream], justid=True))
        errors = [reply for reply in replies.values() if isinstance(reply, Exception)]
        if errors and not self.masters.cluster:
            raise errors[0]
        for error in errors[:1]:  # (a master refusing writes, say: its entries are refreshed next time, the
            log.warning("some entries not refreshed: %s", error)  # others' now; nobody can claim them there)

    def hand_back(self, refs: list[Ref], idle_ms: int) -> None:
        """Make entries claimable by other workers at once (as if idle for idle_ms)."""
        for stream, ids in _by_stream(refs).items():
            self.client.xclaim(stream, self.group, self.consumer, 0, ids, idle=idle_ms, justid=True)

    def ack(self, refs: list[Ref]) -> None:
        for stream, ids in _by_stream(refs).items():
            self.client.xack(stream, self.group, *ids)

    def ack_each(self, refs: list[Ref]) -> list[Ref]:
        """Acknowledge entries master by master (a single Redis's failure raises, as `ack`'s): those of a master
        that does not answer now, or refuses, are answered (they stay pending: `retry_own` finds them)."""
        ids = _by_stream(refs)
        replies = self._each_master(list(ids), lambda pipe, stream: pipe.xack(stream, self.group, *ids[stream]))
        errors = [reply for reply in replies.values() if isinstance(reply, Exception)]
        if errors and not self.masters.cluster:
            raise errors[0]
        done = {stream for stream, reply in replies.items() if not isinstance(reply, Exception)}
        return [ref for ref in refs if ref[0] not in done]

    def dead_letter(self, entry: Entry, reason: str) -> None:
        """Move the entry to its partition's dead-letter stream (one transaction: one slot)."""
        stream = entry.stream or self.streams[0]
        record: dict[FieldT, EncodableT] = {k: v for k, v in entry.fields.items()}
        record.update({"source_stream": stream, "source_id": entry.id, "reason": reason, "at": repr(time.time())})
        pipe = self.client.pipeline(transaction=True)
        pipe.xadd(names.stream(names.DEAD, names.stream_partition(stream)), record, maxlen=10_000)
        pipe.xack(stream, self.group, entry.id)
        pipe.execute()
        log.error("dead-lettered %s %s: %s", stream, entry.id, reason)


def _by_stream(refs: Iterable[Ref]) -> dict[str, list[StreamIdT]]:
    out: dict[str, list[StreamIdT]] = defaultdict(list)
    for stream, eid in refs:
        out[stream].append(eid)
    return out
