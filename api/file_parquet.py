"""A file's JSONL lines as a Parquet table (`GET /v1/files/{id}/content?format=parquet`), one row per line.

A batch's output and error files (purpose `batch_output`) give RESULT_SCHEMA: the result's id and custom_id,
the response's status code, request id and body (JSON text), and the error's code and message (null where the
line has none). An input file (purpose `batch`) gives INPUT_SCHEMA: each request's custom_id, method, url and
body (JSON text); a line that is not a JSON object gives a row of nulls. The table is built ROWS lines at a
time as the lines are read from Redis (each record batch converted off the event loop) and streamed to the client
as it is written."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

MEDIA_TYPE = "application/vnd.apache.parquet"
ROWS = 4096  # lines per record batch

RESULT_SCHEMA = pa.schema([("id", pa.string()), ("custom_id", pa.string()), ("status_code", pa.int32()),
                           ("request_id", pa.string()), ("body", pa.string()), ("error_code", pa.string()),
                           ("error_message", pa.string())])
INPUT_SCHEMA = pa.schema([("custom_id", pa.string()), ("method", pa.string()), ("url", pa.string()),
                          ("body", pa.string())])

Row = dict[str, Any]


def _object(line: str) -> dict[str, Any]:
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        return {}
    return obj if isinstance(obj, dict) else {}


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _json(value: Any) -> str | None:
    return None if value is None else orjson.dumps(value).decode()


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def result_row(line: str) -> Row:
    obj = _object(line)
    response = _dict(obj.get("response"))
    error = _dict(obj.get("error"))
    code = response.get("status_code")
    return {"id": _text(obj.get("id")), "custom_id": _text(obj.get("custom_id")),
            "status_code": code if isinstance(code, int) else None, "request_id": _text(response.get("request_id")),
            "body": _json(response.get("body")), "error_code": _text(error.get("code")),
            "error_message": _text(error.get("message"))}


def input_row(line: str) -> Row:
    obj = _object(line)
    return {"custom_id": _text(obj.get("custom_id")), "method": _text(obj.get("method")),
            "url": _text(obj.get("url")), "body": _json(obj.get("body"))}


async def parquet_of(lines: AsyncIterator[str], purpose: str) -> AsyncIterator[bytes]:
    """The lines (blank ones skipped) as a Parquet file of the purpose's schema, sent as it is written: each record
    batch's row group as soon as it is encoded, the footer last. The API holds one batch of lines at a time,
    whatever the file's size."""
    schema, row = (INPUT_SCHEMA, input_row) if purpose == "batch" else (RESULT_SCHEMA, result_row)
    sink = _Sink()
    writer = pq.ParquetWriter(pa.PythonFile(sink, mode="w"), schema)
    try:
        yield sink.take()  # the header
        chunk: list[str] = []
        async for line in lines:
            if line.strip():
                chunk.append(line)
            if len(chunk) >= ROWS:
                await asyncio.to_thread(_write, writer, schema, row, chunk)
                chunk = []
                yield sink.take()
        if chunk:
            await asyncio.to_thread(_write, writer, schema, row, chunk)
    finally:
        writer.close()  # the footer (or, for a client gone, nothing anyone reads)
    yield sink.take()


class _Sink(io.RawIOBase):
    """Where the writer writes: bytes held only until taken, and the position counted over all of them (Parquet's
    footer records where each column chunk starts)."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[bytes] = []
        self.written = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        chunk = bytes(data)
        self.parts.append(chunk)
        self.written += len(chunk)
        return len(chunk)

    def tell(self) -> int:
        return self.written

    def take(self) -> bytes:
        out = b"".join(self.parts)
        self.parts.clear()
        return out


def _write(writer: pq.ParquetWriter, schema: pa.Schema, row: Callable[[str], Row], lines: list[str]) -> None:
    writer.write_batch(pa.RecordBatch.from_pylist([row(line) for line in lines], schema=schema))
