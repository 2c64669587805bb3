"""Message schemas between stages."""

from __future__ import annotations

import pyarrow as pa
import pytest
from pydantic import ValidationError

from shared.jobs import Job
from shared.schemas import (
    DELTA_SCHEMA,
    TOKENIZED_SCHEMA,
    GenerationRequest,
    Request,
    batch_requests,
    from_ipc,
    requests_batch,
    to_ipc,
)


def test_tokenized_batch_round_trips() -> None:
    reqs = [Request(f"job_{i}", list(range(i + 1)), max_tokens=16, temperature=0.5, top_p=0.75, top_k=40,
                    seed=2**62 + i, stop=["\n\n", "END"], stop_token_ids=[2], ignore_eos=i % 2 == 0) for i in range(5)]
    back = batch_requests(from_ipc(to_ipc(requests_batch(reqs)), TOKENIZED_SCHEMA))
    assert back == reqs  # 0.5 and 0.75 are exact in float32, the wire type of both
    assert "resume_ids" not in TOKENIZED_SCHEMA.names  # set by the inference worker, never sent


def test_the_door_makes_the_engine_request() -> None:
    """What the API validated is what the engine receives: the floors applied once, a missing seed drawn once."""
    req = GenerationRequest(prompt="x", max_tokens=7, temperature=0.001, top_p=0.0001, seed=-1, stop="END",
                            stop_token_ids=[5], ignore_eos=True).tokenized("job_1", [1, 2])
    assert req == Request("job_1", [1, 2], max_tokens=7, temperature=0.0, top_p=0.001, seed=2**63 - 1, stop=["END"],
                          stop_token_ids=[5], ignore_eos=True)
    assert req.greedy
    seeds = {GenerationRequest(prompt="x").tokenized("j", [1]).seed for _ in range(4)}
    assert len(seeds) == 4 and all(0 <= s < 2**63 for s in seeds)


def test_delta_batch_round_trips_and_schema_is_checked() -> None:
    rows = [{"job_id": "a", "token_ids": [1, 2], "finish_reason": None, "error": None},
            {"job_id": "b", "token_ids": [], "finish_reason": "error", "error": "boom"}]
    data = to_ipc(pa.RecordBatch.from_pylist(rows, schema=DELTA_SCHEMA))
    assert [{k: v for k, v in r.items() if v is not None or k in ("finish_reason", "error")}
            for r in from_ipc(data, DELTA_SCHEMA).to_pylist()] == rows
    with pytest.raises(ValueError):
        from_ipc(data, TOKENIZED_SCHEMA)


def test_generation_request_validation() -> None:
    assert GenerationRequest(prompt="x", stop="END").stop == ["END"]
    assert GenerationRequest(messages=[{"role": "user", "content": "hi"}]).messages[0].role == "user"
    for bad in ({}, {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, {"messages": []},
                {"prompt": "x", "max_tokens": 0}, {"prompt": "x", "temperature": 3}, {"prompt": "x", "stop": [""]},
                {"prompt": "x", "unknown": 1}):
        with pytest.raises(ValidationError):
            GenerationRequest(**bad)


def test_job_from_record() -> None:
    job = Job.from_record({"id": "job_1", "status": "succeeded", "model": "m", "text": "hi",
                           "finish_reason": "stop", "prompt_tokens": "3", "completion_tokens": "2",
                           "created_at": "1.0", "started_at": "2.0", "first_token_at": "", "finished_at": "3.5"})
    assert job.ended and job.usage.total_tokens == 5 and job.first_token_at is None and job.finished_at == 3.5
