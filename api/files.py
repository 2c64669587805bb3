"""Files in Redis, for the Batch API. An upload is appended line by line as it arrives (never held whole) to a
list of its lines, so every API process reads any file back as text. Each file belongs to the key that made it
and expires after `ttl_s` (JOB_TTL_S + BATCH_WINDOW_S). A batch's output and error files are its result hashes
(index -> line), read in index order: a result is written once, by line, whoever writes it.

A key's files count against its `max_file_bytes`: each file's size and expiry are noted in the key's sizes hash
(shared/scripts/file_bytes.lua), so the total drops when a file is deleted and when one expires (without a key,
AUTH off, only MAX_FILE_BYTES per file applies)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any, cast

import redis.asyncio as aredis

from shared import file_ops, names
from shared.file_ops import count_bytes
from shared.job_ops import NotCopied, Writes, execute_copied, replies
from shared.redis_client import send_once

MAX_FILE_BYTES = 64 * 2**20  # an upload larger answers 413
PURPOSES = ("batch", "batch_output")


class TooLarge(ValueError):
    """An upload over MAX_FILE_BYTES, or over what its key may still store (413)."""


class FileStore:
    def __init__(self, client: aredis.Redis, ttl_s: int) -> None:
        self.r, self.ttl_s = client, ttl_s  # a decoding client: replies are text

    async def upload(self, owner: str, purpose: str, filename: str, chunks: AsyncIterator[bytes],
                     max_stored: int = 0) -> dict[str, Any]:
        """Store an upload line by line as it arrives (a Redis list: each element a whole line, so any process
        reads it back as text); TooLarge when it exceeds MAX_FILE_BYTES or would take the owner's files past
        `max_stored` bytes (0: no cap), ValueError when it is not UTF-8 (nothing is kept either way)."""
        file_id = "file-" + uuid.uuid4().hex
        data = names.file_key(file_id, "data")
        used = await self.stored_bytes(owner) if max_stored else 0
        size, rest, newline = 0, b"", True
        try:
            async for chunk in chunks:
                size += len(chunk)
                if size > MAX_FILE_BYTES:
                    raise TooLarge(f"the file is larger than {MAX_FILE_BYTES} bytes")
                if max_stored and used + size > max_stored:
                    raise _over(max_stored, used)
                *whole, rest = (rest + chunk).split(b"\n")
                await self._push(data, whole)
            newline = rest == b""
            if rest:
                await self._push(data, [rest])
            if max_stored:  # the check that counts: uploads of the same key may have run meanwhile
                added, used = await self._count(owner, file_id, size, max_stored)
                if not added:
                    raise _over(max_stored, used)
        except BaseException:
            await self.r.delete(data)
            raise
        if owner and not max_stored:
            await self._count(owner, file_id, size)
        return await self._record(file_id, owner, purpose, filename, size, "list", newline=newline)

    async def stored_bytes(self, owner: str) -> int:
        """The bytes of the owner's files that have not expired or been deleted."""
        return (await self._count(owner, "", 0))[1]

    async def _count(self, owner: str, file_id: str, size: int, cap: int = 0) -> tuple[bool, int]:
        """Note a file's size against its owner (file_bytes.lua): (added, the owner's total)."""
        return await count_bytes(self.r, owner, file_id, size, self.ttl_s, cap)

    async def _push(self, key: str, lines: list[bytes]) -> None:
        if not lines:
            return
        try:
            text = [line.decode("utf-8") for line in lines]
        except UnicodeDecodeError:
            raise ValueError("the file is not UTF-8 text") from None
        # sent once: a client's retry after a lost reply would push the lines twice (the upload fails instead,
        # and its lines are deleted)
        replies(await send_once(self.r, key, [("RPUSH", key, *text), ("EXPIRE", key, self.ttl_s)]))

    async def of_lines(self, file_id: str, owner: str, filename: str, lines_key: str, size: int) -> dict[str, Any]:
        """A file whose content is a hash of lines (a batch's results), in index order. It counts against its
        owner's stored bytes, whatever the cap: a batch's results are kept."""
        await self.r.expire(lines_key, self.ttl_s)
        if owner:
            await self._count(owner, file_id, size)
        return await self._record(file_id, owner, "batch_output", filename, size, "lines", lines_key)

    async def _record(self, file_id: str, owner: str, purpose: str, filename: str, size: int, kind: str,
                      source: str = "", newline: bool = True) -> dict[str, Any]:
        writes = Writes()
        meta = file_ops.queue_record(writes, file_id, owner, purpose, filename, size, kind,
                                     source or names.file_key(file_id, "data"), self.ttl_s, newline)
        copied = False
        try:
            copied = (await execute_copied(self.r, writes))[1]
        finally:
            if not copied:  # not promised, so not kept: the retry uploads anew, and counts its bytes anew
                await self.delete({"id": file_id, "owner": owner, "kind": kind,
                                   "source": source or names.file_key(file_id, "data")})
        if not copied:
            raise NotCopied(f"file {file_id}")
        return file_object(meta)

    async def meta(self, file_id: str, owner: str) -> dict[str, Any] | None:
        """The caller's file's record; another tenant's file is as absent as one that never was."""
        meta = cast("dict[str, str]", await self.r.hgetall(names.file_key(file_id, "meta")))
        if not meta or (meta.get("owner") or "") != owner:
            return None
        return meta

    async def lines(self, meta: dict[str, Any]) -> AsyncIterator[str]:
        """The file's lines, without their newlines, a page at a time."""
        if meta["kind"] == "lines":  # a batch's results, in index order
            keys = sorted(int(k) for k in await self.r.hkeys(meta["source"]))
            for i in range(0, len(keys), 256):
                for line in cast("list[str | None]", await self.r.hmget(meta["source"], keys[i:i + 256])):
                    if line is not None:
                        yield line
            return
        at = 0
        while page := cast("list[str]", await self.r.lrange(meta["source"], at, at + 999)):
            for line in page:
                yield line
            at += len(page)

    async def content(self, meta: dict[str, Any]) -> AsyncIterator[bytes]:
        """The file's bytes as uploaded (a batch's results: JSONL)."""
        pending: str | None = None
        async for line in self.lines(meta):
            if pending is not None:
                yield (pending + "\n").encode()
            pending = line
        if pending is not None:
            yield (pending + ("\n" if int(meta.get("newline", 1)) else "")).encode()

    async def delete(self, meta: dict[str, Any], promised: bool = False) -> None:
        """The file's record, its data and its place in its owner's index and byte count. `promised` (a client's
        DELETE): on a cluster, on a replica before the answer (NotCopied otherwise)."""
        writes = Writes()
        writes.delete(names.file_key(meta["id"], "meta"))
        if meta.get("source"):  # its lines (uploaded), or the results of the batch that ended with it
            writes.delete(meta["source"])
        # (its place in its owner's index stays, a page cursor's, until uploads trim it with its TTL: the listing skips
        # ids without a record, and a page `after` it goes on from there rather than from the start)
        writes.hdel(names.file_bytes_key(meta.get("owner") or ""), meta["id"])
        copied = (await execute_copied(self.r, writes))[1]
        if promised and not copied:
            raise NotCopied(f"the deletion of file {meta['id']}")

    async def listing(self, owner: str, limit: int, after: str | None, purpose: str | None = None,
                      newest_first: bool = True) -> tuple[list[dict[str, Any]], bool]:
        """A page of the owner's files (of `purpose` only, when given), after the file `after`; whether more
        follow."""
        index = names.files_index(owner)
        ids = cast("list[str]", await (self.r.zrevrange(index, 0, -1) if newest_first else self.r.zrange(index, 0, -1)))
        if after in ids:
            ids = ids[ids.index(after) + 1:]
        out = []
        for file_id in ids:
            meta = await self.meta(file_id, owner)
            if meta is not None and (purpose is None or meta["purpose"] == purpose):
                out.append(file_object(meta))
            if len(out) > limit:
                break
        return out[:limit], len(out) > limit


def file_object(meta: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's FileObject."""
    return {"id": meta["id"], "object": "file", "bytes": int(meta["bytes"]), "created_at": int(meta["created_at"]),
            "filename": meta["filename"], "purpose": meta["purpose"], "status": "processed", "status_details": None}


def _over(cap: int, used: int) -> TooLarge:
    return TooLarge(f"this key may store {cap} bytes of files (its max_file_bytes) and {used} are in use; "
                    "delete files (DELETE /v1/files/{id}) or wait for them to expire")
