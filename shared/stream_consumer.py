"""At-least-once consumption of a Redis stream by a consumer group.

New entries come from XREADGROUP; entries a dead consumer (not a live worker of its pool, as
shared.signals reads the pool's registry) left pending are taken over with XCLAIM once idle past a
deadline. A live consumer keeps its own in-flight entries fresh (XCLAIM ... JUSTID resets their
idle time) so long generations are not stolen. An entry delivered more than `delivery_limit` times
goes to the dead-letter stream instead. Entries already delivered twice are claimed one at a time,
so a poison entry reaches the dead-letter stream alone.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import redis

from shared import names
from shared.redis_client import text
from shared.signals import read_live

log = logging.getLogger(__name__)

Fields = dict[bytes | str, bytes | str]


@dataclass
class Entry:
    id: str
    fields: Fields
    deliveries: int = 1


class StreamConsumer:
    def __init__(self, client: redis.Redis, stream: str, group: str, consumer: str, pool: str,
                 claim_idle_ms: int = 30_000, delivery_limit: int = 3) -> None:
        self.client, self.stream, self.group, self.consumer = client, stream, group, consumer
        self.pool = pool  # consumers are workers of this pool; its registry says who is alive
        self.claim_idle_ms, self.delivery_limit = claim_idle_ms, delivery_limit
        self._quiet_until = 0.0

    def ensure_group(self) -> None:
        try:
            self.client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def read(self, count: int, block_ms: int | None) -> list[Entry]:
        """New entries; block_ms None returns at once, 0 would wait forever."""
        try:
            reply = self.client.xreadgroup(self.group, self.consumer, {self.stream: ">"}, count=count, block=block_ms)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self.ensure_group()  # the stream was deleted (or Redis lost its data): start over
            return []
        entries: list[Entry] = []
        for _stream, items in reply or []:
            entries.extend(Entry(text(eid), fields) for eid, fields in items if fields is not None)
        return entries

    def note_outage(self) -> None:
        """After losing Redis, live owners need time to refresh their entries and heartbeats
        before anything idle can be taken for a dead consumer's."""
        self._quiet_until = time.monotonic() + self.claim_idle_ms / 1000

    def claim_stale(self, count: int = 64) -> tuple[list[Entry], list[Entry]]:
        """Take over entries idle past the deadline whose consumer is not a live worker of the pool.
        Returns (to process, dead-lettered)."""
        if time.monotonic() < self._quiet_until:
            return [], []
        try:
            rows = self.client.xpending_range(self.stream, self.group, min="-", max="+", count=count * 4,
                                              idle=self.claim_idle_ms)
        except redis.ResponseError as exc:
            if "NOGROUP" in str(exc):
                self.ensure_group()
                return [], []
            raise
        owners = {text(r["consumer"]) for r in rows} - {self.consumer}
        if not owners:
            return [], []
        dead_owners = owners - set(read_live(self.client, (self.pool,))[self.pool])
        stale = [r for r in rows if text(r["consumer"]) in dead_owners][:count]
        if not stale:
            return [], []
        # an entry delivered twice already may be what killed its workers: take such entries one
        # at a time, so one that kills again takes no other entry's delivery count with it
        suspects = [r for r in stale if int(r["times_delivered"]) >= 2]
        if suspects:
            stale = suspects[:1]
        # XCLAIM re-checks the idle time, so two workers claiming at once cannot both win
        return self._claim(stale, self.claim_idle_ms)

    def retry_own(self, idle_ms: int, count: int = 64) -> tuple[list[Entry], list[Entry]]:
        """Take back this consumer's own entries left pending (unacknowledged: their work failed)
        for idle_ms or more, for another try. Returns (to process, dead-lettered)."""
        rows = self.client.xpending_range(self.stream, self.group, min="-", max="+", count=count,
                                          consumername=self.consumer, idle=idle_ms)
        return self._claim(rows, idle_ms) if rows else ([], [])

    def _claim(self, rows: list[dict], idle_ms: int) -> tuple[list[Entry], list[Entry]]:  # type: ignore[type-arg]
        """XCLAIM the pending `rows` still idle for idle_ms; acknowledge entries trimmed meanwhile and
        dead-letter those past the delivery limit. Returns (to process, dead-lettered)."""
        deliveries = {text(r["message_id"]): int(r["times_delivered"]) + 1 for r in rows}
        claimed = self.client.xclaim(self.stream, self.group, self.consumer, idle_ms, list(deliveries))
        self.ack([text(eid) for eid, fields in claimed if fields is None])
        keep, dead = [], []
        for eid, fields in claimed:
            if fields is not None:
                entry = Entry(text(eid), fields, deliveries.get(text(eid), 1))
                (dead if entry.deliveries > self.delivery_limit else keep).append(entry)
        for entry in dead:
            self.dead_letter(entry, f"delivered {entry.deliveries} times without completing")
        return keep, dead

    def refresh(self, ids: list[str]) -> None:
        """Reset the idle time of entries this consumer still works on."""
        if ids:
            self.client.xclaim(self.stream, self.group, self.consumer, 0, ids, justid=True)

    def ack(self, ids: list[str]) -> None:
        if ids:
            self.client.xack(self.stream, self.group, *ids)

    def dead_letter(self, entry: Entry, reason: str) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.xadd(names.DEAD_LETTER_STREAM, {**entry.fields, "source_stream": self.stream, "source_id": entry.id,
                                              "reason": reason, "at": repr(time.time())}, maxlen=10_000)
        pipe.xack(self.stream, self.group, entry.id)
        pipe.execute()
        log.error("dead-lettered %s %s: %s", self.stream, entry.id, reason)
