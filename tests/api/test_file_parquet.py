"""A file read back as Parquet is sent as it is written: the API holds one record batch of lines at a time, not
the whole table, and the pieces joined are one Parquet file with every line's row."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator

import pyarrow.parquet as pq

from api.file_parquet import ROWS, parquet_of


async def _lines(n: int) -> AsyncIterator[str]:
    for i in range(n):
        body = {"id": f"chatcmpl-{i}", "choices": [{"message": {"content": "word " * 40}}]}
        yield json.dumps({"id": f"batch_req_{i}", "custom_id": f"line-{i}",
                          "response": {"status_code": 200, "request_id": f"req-{i}", "body": body}, "error": None})
        if i % 1000 == 0:
            yield "\n"  # blank lines are no rows


async def test_a_large_file_streams_in_pieces_that_join_to_every_row() -> None:
    n = 3 * ROWS + 17
    pieces = [piece async for piece in parquet_of(_lines(n), "batch_output")]
    whole = b"".join(pieces)
    table = pq.read_table(io.BytesIO(whole))
    assert table.num_rows == n
    assert table.column("custom_id").to_pylist() == [f"line-{i}" for i in range(n)]
    assert json.loads(table.column("body")[n - 1].as_py())["id"] == f"chatcmpl-{n - 1}"
    # a row group per ROWS lines, each sent on its own: no piece holds much more than one batch's share
    assert sum(1 for p in pieces if p) >= 4
    assert max(len(p) for p in pieces) < len(whole) / 2


async def test_a_client_gone_mid_file_closes_the_writer() -> None:
    stream = parquet_of(_lines(2 * ROWS + 1), "batch_output")
    first = await anext(stream)
    assert first.startswith(b"PAR1")
    await anext(stream)
    await stream.aclose()  # what the server does when the client disconnects: no error, nothing left open
