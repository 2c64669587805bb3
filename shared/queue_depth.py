"""The queue's depth, read in one place: per partition and model queue, the jobs submitted (submit.lua counts them)
and the jobs that have left the queue (started, failed or cancelled: start.lua and finish.lua count them) since the
service began. The API's wait estimate (api/quota.py) sums them over every model; its queue positions
(api/store.py) use each partition's depth of the job's model."""

from __future__ import annotations

from collections.abc import Sequence
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


async def read_counters(client: Any, models: Sequence[str] = ("",)) -> list[PartitionCounters]:
    """Every partition's counters summed over the queues of `models` ('' the default's), in partition order: one
    GET a key in one pipeline (on a cluster each key is in its partition's slot, so no MGET across them)."""
    pipe = client.pipeline(transaction=False)
    for p in names.partitions():
        for model in models:
            pipe.get(names.submitted_counter(p, model))
            pipe.get(names.dequeued_counter(p, model))
    got = [int(n or 0) for n in await pipe.execute()]
    step = 2 * len(models)
    return [PartitionCounters(sum(got[at:at + step:2]), sum(got[at + 1:at + step:2]))
            for at in range(0, len(got), step)]
