"""Files in Redis, for the Batch API. An upload is appended line by line as it arrives (never held whole) to a
list of its lines, so every API process reads any file back as text. Each file belongs to the key that made it
and expires after FILE_TTL_S. A batch's output and error files are its result hashes (index -> line), read in
index order: a result is written once, by line, whoever writes it."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aredis

from shared import names

MAX_FILE_BYTES = 64 * 2**20  # an upload larger answers 413
PURPOSES = ("batch", "batch_output")


class FileStore:
    def __init__(self, client: aredis.Redis, ttl_s: int) -> None:
        self.r, self.ttl_s = client, ttl_s

    async def upload(self, owner: str, purpose: str, filename: str, chunks: AsyncIterator[bytes]) -> dict[str, Any]:
        """Store an upload line by line as it arrives (a Redis list: each element a whole line, so any process
        reads it back as text); ValueError when it exceeds MAX_FILE_BYTES or is not UTF-8 (nothing is kept)."""
        file_id = "file-" + uuid.uuid4().hex
        data = names.file_key(file_id, "data")
        size, rest, newline = 0, b"", True
        try:
            async for chunk in chunks:
                size += len(chunk)
                if size > MAX_FILE_BYTES:
                    raise ValueError(f"the file is larger than {MAX_FILE_BYTES} bytes")
                *whole, rest = (rest + chunk).split(b"\n")
                await self._push(data, whole)
            newline = rest == b""
            if rest:
                await self._push(data, [rest])
        except BaseException:
            await self.r.delete(data)
            raise
        return await self._record(file_id, owner, purpose, filename, size, "list", newline=newline)

    async def _push(self, key: str, lines: list[bytes]) -> None:
        if not lines:
            return
        try:
            text = [line.decode("utf-8") for line in lines]
        except UnicodeDecodeError:
            raise ValueError("the file is not UTF-8 text") from None
        pipe = self.r.pipeline(transaction=False)
        pipe.rpush(key, *text)
        pipe.expire(key, self.ttl_s)
        await pipe.execute()

    async def of_lines(self, file_id: str, owner: str, filename: str, lines_key: str, size: int) -> dict[str, Any]:
        """A file whose content is a hash of lines (a batch's results), in index order."""
        await self.r.expire(lines_key, self.ttl_s)
        return await self._record(file_id, owner, "batch_output", filename, size, "lines", lines_key)

    async def _record(self, file_id: str, owner: str, purpose: str, filename: str, size: int, kind: str,
                      source: str = "", newline: bool = True) -> dict[str, Any]:
        now = int(time.time())
        meta = {"id": file_id, "owner": owner, "purpose": purpose, "filename": filename, "bytes": size,
                "created_at": now, "kind": kind, "source": source or names.file_key(file_id, "data"),
                "newline": int(newline)}
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(names.file_key(file_id, "meta"), mapping=meta)
        pipe.expire(names.file_key(file_id, "meta"), self.ttl_s)
        pipe.zadd(names.files_index(owner), {file_id: now})
        pipe.zremrangebyscore(names.files_index(owner), 0, now - self.ttl_s)  # expired files leave the index
        pipe.expire(names.files_index(owner), self.ttl_s)
        await pipe.execute()
        return file_object(meta)

    async def meta(self, file_id: str, owner: str) -> dict[str, Any] | None:
        """The caller's file's record; another tenant's file is as absent as one that never was."""
        meta = await self.r.hgetall(names.file_key(file_id, "meta"))
        if not meta or (meta.get("owner") or "") != owner:
            return None
        return meta

    async def lines(self, meta: dict[str, Any]) -> AsyncIterator[str]:
        """The file's lines, without their newlines, a page at a time."""
        if meta["kind"] == "lines":  # a batch's results, in index order
            keys = sorted(int(k) for k in await self.r.hkeys(meta["source"]))
            for i in range(0, len(keys), 256):
                for line in await self.r.hmget(meta["source"], keys[i:i + 256]):
                    if line is not None:
                        yield line
            return
        at = 0
        while page := await self.r.lrange(meta["source"], at, at + 999):
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

    async def delete(self, meta: dict[str, Any]) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.delete(names.file_key(meta["id"], "meta"))
        if meta["kind"] == "list":
            pipe.delete(meta["source"])
        pipe.zrem(names.files_index(meta.get("owner") or ""), meta["id"])
        await pipe.execute()

    async def listing(self, owner: str, limit: int, after: str | None) -> tuple[list[dict[str, Any]], bool]:
        ids = await self.r.zrevrange(names.files_index(owner), 0, -1)
        if after in ids:
            ids = ids[ids.index(after) + 1:]
        out = []
        for file_id in ids:
            meta = await self.meta(file_id, owner)
            if meta is not None:
                out.append(file_object(meta))
            if len(out) > limit:
                break
        return out[:limit], len(out) > limit


def file_object(meta: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's FileObject."""
    return {"id": meta["id"], "object": "file", "bytes": int(meta["bytes"]), "created_at": int(meta["created_at"]),
            "filename": meta["filename"], "purpose": meta["purpose"], "status": "processed", "status_details": None}
