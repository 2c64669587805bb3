"""The queue's depth, read in one place: per partition, the jobs submitted (submit.lua counts them) and the
jobs that have left the queue (started, failed or cancelled: start.lua and finish.lua count them) since the
service began. The API's wait estimate (api/quota.py) sums them; its queue positions (api/store.py) use each
partition's depth."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared import names


@dataclass(frozen=True)
class PartitionCounters:
    submitted: int
    dequeued: int

    @property
    def depth(self) -> int:
        """Jobs waiting in the partition (never below 0: the counters are read one after the other)."""
        return max(0, self.submitted - self.dequeued)


async def read_counters(client: Any) -> list[PartitionCounters]:
    """Every partition's counters, in partition order: one GET a key in one pipeline (on a cluster each key is
    in its partition's slot, so no MGET across them)."""
    pipe = client.pipeline(transaction=False)
    for p in names.partitions():
        pipe.get(names.submitted_counter(p))
        pipe.get(names.dequeued_counter(p))
    got = await pipe.execute()
    return [PartitionCounters(int(s or 0), int(d or 0)) for s, d in zip(got[::2], got[1::2])]
