"""A stored file's record, and a tenant's stored files' bytes (file_bytes.lua): the writes and the call's keys and
arguments built here, from shared/names.py, for the files API (api/files.py) and the batch driver's result files
(workers/batch_driver.py)."""

from __future__ import annotations

import time
from typing import Any

from shared import names, scripts
from shared.job_ops import Write


def file_bytes_write(owner: str, file_id: str = "", size: int = 0, ttl_s: int = 0, cap: int = 0) -> Write:
    """A file_bytes call: the owner's stored bytes, and with `file_id` that file's `size` added (kept `ttl_s`)
    unless the total would pass `cap` (0 none)."""
    now = int(time.time())
    return [names.file_bytes_key(owner)], [now, file_id, size, now + ttl_s, cap]


async def count_bytes(client: Any, owner: str, file_id: str = "", size: int = 0, ttl_s: int = 0,
                      cap: int = 0) -> tuple[bool, int]:
    """(whether the file was added, or only counted; the owner's total bytes after)."""
    got = await scripts.FILE_BYTES.acall(client, *file_bytes_write(owner, file_id, size, ttl_s, cap))
    return bool(int(got[0])), int(got[1])


def queue_record(pipe: Any, file_id: str, owner: str, purpose: str, filename: str, size: int, kind: str,
                 source: str, ttl_s: int, newline: bool = True) -> dict[str, Any]:
    """Queue a file's record (kept `ttl_s`) and its place in its owner's index on a pipeline, sync or asyncio
    alike; answers the record. `kind` "data": the bytes are at `source`; "lines": `source` is a hash of lines."""
    now = int(time.time())
    meta: dict[str, Any] = {"id": file_id, "owner": owner, "purpose": purpose, "filename": filename,
                            "bytes": size, "created_at": now, "kind": kind, "source": source, "newline": int(newline)}
    pipe.hset(names.file_key(file_id, "meta"), mapping=meta)
    pipe.expire(names.file_key(file_id, "meta"), ttl_s)
    pipe.zadd(names.files_index(owner), {file_id: now})
    pipe.zremrangebyscore(names.files_index(owner), 0, now - ttl_s)  # expired files leave the index
    pipe.expire(names.files_index(owner), ttl_s)
    return meta
