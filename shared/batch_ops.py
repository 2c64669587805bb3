"""A batch's script calls (the Batch API's driver, workers/batch_driver.py; the after-job drain): each builds its
keys and arguments here, from shared/names.py, as shared/job_ops.py does a job's."""

from __future__ import annotations

from typing import Any

from redis.asyncio import cluster as acluster

from shared import names, scripts
from shared.job_ops import NotCopied, Write, apromise, note_failure_on
from shared.scripts.codes import BatchResultCode


def result_write(batch_id: str, index: str, line: bytes, ok: bool) -> Write:
    """A batch_result call (batch_result.lua): line `index`'s result `line` (JSON), to the batch's `out` hash
    and its `completed` count when `ok`, else to `err` and `failed`."""
    keys = [names.batch_key(batch_id), names.batch_key(batch_id, "out" if ok else "err"),
            names.batch_key(batch_id, "inflight")]
    return keys, [index, line, "completed" if ok else "failed"]


async def record_result(client: Any, batch_id: str, index: str, line: bytes, ok: bool) -> BatchResultCode:
    """Record a line's result exactly once (see BatchResultCode)."""
    return BatchResultCode(int(await scripts.BATCH_RESULT.acall(client, *result_write(batch_id, index, line, ok))))


def cancel_write(batch_id: str, now: float) -> Write:
    """A batch_cancel call (batch_cancel.lua): the batch `cancelling` if it is still running."""
    return [names.batch_key(batch_id)], [now]


async def request_cancel(client: Any, batch_id: str, now: float) -> bool:
    """Mark the batch `cancelling` if it is still validating or in progress (whether it was), on a replica before
    the answer on a cluster (NotCopied otherwise: a failover must not undo the cancel a client was told of)."""
    write = cancel_write(batch_id, now)
    if not isinstance(client, acluster.RedisCluster):
        return bool(await scripts.BATCH_CANCEL.acall(client, *write))
    reply, copied = await apromise(client, scripts.BATCH_CANCEL, write, f"the cancel of batch {batch_id}")
    if reply and not copied:
        raise NotCopied(f"the cancel of batch {batch_id}")
    return bool(reply)


def queue_result(pipe: Any, batch_id: str, index: str, line: bytes, ok: bool) -> None:
    """Queue a batch_result call on `pipe`; its reply there is a BatchResultCode. The scripts must be loaded on
    the pipeline's connection first (`scripts.aload`) unless its client replays NOSCRIPT (shared.redis_client)."""
    scripts.BATCH_RESULT.queue(pipe, *result_write(batch_id, index, line, ok))


def queue_note_failure(pipe: Any, batch_id: str, why: str) -> None:
    """Queue a note_failure call (note_failure.lua) on the batch's record: why its webhook's last delivery
    failed. Its reply there is a NoteFailureCode."""
    scripts.NOTE_FAILURE.queue(pipe, *note_failure_on(names.batch_key(batch_id), why))
