"""The Files and Batch APIs through the official openai SDK, against the running stack (tiny model; its Celery
worker drives the batches): a batch with malformed lines runs the rest, its output and error files parse, counts
and custom ids match, and read back as Parquet tables; a batch cancelled midway keeps its finished lines; bounds
answer the right 4xx (another key: tests/api/test_tenants.py; per-key caps, expiry and webhooks:
tests/api/test_batch_limits.py)."""

from __future__ import annotations

import io
import json
import socket

import openai
import pyarrow.parquet as pq
import pytest

from tests.helpers import until


@pytest.fixture
def oai(tiny_stack) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    assert tiny_stack.by_role("celery"), "batches run in the Celery worker: the stack needs one"
    return openai.OpenAI(base_url=tiny_stack.url + "/v1", api_key="unused", max_retries=0)


def _jsonl(lines: list[object]) -> bytes:
    return b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)


def _line(i: int, model: str, url: str = "/v1/chat/completions", **body: object) -> dict[str, object]:
    if url == "/v1/completions":
        payload: dict[str, object] = {"model": model, "prompt": f"Count to {i}:", "max_tokens": 4, **body}
    else:
        payload = {"model": model, "messages": [{"role": "user", "content": f"Say {i}."}], "max_tokens": 4, **body}
    return {"custom_id": f"req-{i}", "method": "POST", "url": url, "body": payload}


def _wait(oai: openai.OpenAI, batch_id: str, states: tuple[str, ...]) -> object:
    until(f"batch {batch_id} in {states}", lambda: oai.batches.retrieve(batch_id).status in states, timeout=120,
          every=0.2)
    return oai.batches.retrieve(batch_id)


def test_a_batch_runs_its_good_lines_and_reports_the_bad_ones(oai: openai.OpenAI) -> None:
    model = oai.models.list().data[0].id
    lines: list[object] = [_line(i, model) for i in range(48)]
    lines.insert(7, b"{not json")
    lines.insert(30, _line(99, model, temperature=7))  # out of bounds: the same check as an interactive request
    f = oai.files.create(file=("in.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
    assert f.bytes == len(_jsonl(lines)) and oai.files.retrieve(f.id).filename == "in.jsonl"
    assert oai.files.content(f.id).content == _jsonl(lines)
    batch = oai.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                               metadata={"run": "a"})
    done = _wait(oai, batch.id, ("completed", "failed"))
    assert done.status == "completed" and done.metadata == {"run": "a"}
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (50, 48, 2)
    out = [json.loads(x) for x in oai.files.content(done.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(48))
    for o in out:
        body = o["response"]["body"]
        assert o["response"]["status_code"] == 200 and body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["role"] == "assistant" and body["usage"]["completion_tokens"] >= 1
    errors = [json.loads(x) for x in oai.files.content(done.error_file_id).text.splitlines()]
    assert len(errors) == 2 and {e["custom_id"] for e in errors} == {None, "req-99"}
    assert all(e["error"]["message"] for e in errors)
    assert batch.id in [b.id for b in oai.batches.list().data]


def test_cancel_midway_keeps_finished_lines(oai: openai.OpenAI) -> None:
    model = oai.models.list().data[0].id
    lines = [_line(i, model, "/v1/completions", max_tokens=64, ignore_eos=True) for i in range(200)]
    f = oai.files.create(file=("big.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
    batch = oai.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    until("some lines done", lambda: oai.batches.retrieve(batch.id).request_counts.completed >= 3, timeout=120,
          every=0.2)
    assert oai.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = _wait(oai, batch.id, ("cancelled",))
    counts = done.request_counts
    assert 3 <= counts.completed < 200 and counts.total == 200
    out = oai.files.content(done.output_file_id).text.splitlines()
    assert len(out) == counts.completed
    assert all(json.loads(x)["response"]["body"]["object"] == "text_completion" for x in out)


def test_bounds_and_unknowns(oai: openai.OpenAI, tiny_stack) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(openai.NotFoundError):
        oai.batches.create(input_file_id="file-nothing", endpoint="/v1/chat/completions", completion_window="24h")
    f = oai.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
    with pytest.raises(openai.BadRequestError):
        oai.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.BadRequestError):
        oai.files.create(file=("x.bin", io.BytesIO(b"\xff\xfe\n")), purpose="batch")
    host, port = tiny_stack.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:  # a 1 GB upload announced: refused at once
        s.sendall(b"POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n"
                  b"Content-Length: 1000000000\r\n\r\n")
        assert s.recv(100).split(b" ")[1] == b"413"
    oai.files.delete(f.id)
    with pytest.raises(openai.NotFoundError):
        oai.files.retrieve(f.id)
    with pytest.raises(openai.NotFoundError):
        oai.batches.retrieve("batch_nothing")


def _parquet(oai: openai.OpenAI, file_id: str) -> list[dict[str, object]]:
    got = oai.files.content(file_id, extra_query={"format": "parquet"})
    assert got.response.headers["content-type"] == "application/vnd.apache.parquet"
    return pq.read_table(io.BytesIO(got.content)).to_pylist()  # type: ignore[no-any-return]


def test_files_read_back_as_parquet(oai: openai.OpenAI) -> None:
    model = oai.models.list().data[0].id
    lines: list[object] = [_line(i, model) for i in range(3)]
    lines.insert(1, b"{not json")
    lines.append(_line(9, model, temperature=7))
    f = oai.files.create(file=("in.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
    rows = _parquet(oai, f.id)
    assert [r["custom_id"] for r in rows] == ["req-0", None, "req-1", "req-2", "req-9"]
    assert rows[1] == {"custom_id": None, "method": None, "url": None, "body": None}  # the line that is not JSON
    assert rows[0]["method"] == "POST" and rows[0]["url"] == "/v1/chat/completions"
    assert json.loads(rows[0]["body"]) == lines[0]["body"]  # type: ignore[index,arg-type]
    batch = oai.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = _wait(oai, batch.id, ("completed", "failed"))
    assert done.status == "completed"
    jsonl = {o["custom_id"]: o for o in map(json.loads, oai.files.content(done.output_file_id).text.splitlines())}
    out = _parquet(oai, done.output_file_id)
    assert sorted(r["custom_id"] for r in out) == ["req-0", "req-1", "req-2"]
    for r in out:
        want = jsonl[r["custom_id"]]
        assert r["id"] == want["id"] and r["status_code"] == 200 and r["request_id"] == want["response"]["request_id"]
        assert json.loads(r["body"]) == want["response"]["body"]
        assert r["error_code"] is None and r["error_message"] is None
    errors = _parquet(oai, done.error_file_id)
    assert {r["custom_id"] for r in errors} == {None, "req-9"}
    assert all(r["status_code"] is None and r["body"] is None and r["error_code"] and r["error_message"]
               for r in errors)
    with pytest.raises(openai.BadRequestError, match="format"):
        oai.files.content(f.id, extra_query={"format": "csv"})
