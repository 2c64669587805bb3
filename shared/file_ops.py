"""A tenant's stored files' bytes (file_bytes.lua, for api/files.py): the call's keys and arguments built
here, from shared/names.py."""

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
