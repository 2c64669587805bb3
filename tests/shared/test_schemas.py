"""Message schemas between stages."""

from __future__ import annotations

import pyarrow as pa
import pytest
from pydantic import ValidationError

from shared.jobs import Job
from shared.limits import Deployment, LimitError
from shared.schemas import (
    TOKENIZED_SCHEMA,
    GenerationRequest,
    Request,
    decode_request,
    encode_request,
    from_ipc,
    to_ipc,
)


def test_a_tokenized_record_round_trips_one_request() -> None:
    reqs = [Request(f"job_{i}", list(range(i + 1)), max_tokens=16, temperature=0.5, top_p=0.75, top_k=40, min_p=0.1,
                    seed=2**62 + i, stop=["\n\n", "END"], stop_token_ids=[2], ignore_eos=i % 2 == 0,
                    bias_ids=[7], bias_values=[-1.5], priority=-3) for i in range(3)]
    assert [decode_request(encode_request(r)) for r in reqs] == reqs
    assert from_ipc(encode_request(reqs[0]), TOKENIZED_SCHEMA).num_rows == 1
    assert "resume_ids" not in TOKENIZED_SCHEMA.names  # set by the inference worker, never sent


def test_a_clients_floats_arrive_as_sent() -> None:
    """0.7 has no exact float32: the wire carries float64, so the engine samples with the 0.7 the client sent."""
    door = GenerationRequest(prompt="x", temperature=0.7, top_p=0.9, presence_penalty=0.3, frequency_penalty=-0.1,
                             repetition_penalty=1.1, logit_bias={5: 0.7}, min_p=0.1)
    req = decode_request(encode_request(door.tokenized("job_1", [1, 2])))
    assert (req.temperature, req.top_p, req.presence_penalty, req.frequency_penalty, req.repetition_penalty,
            req.bias_values, req.min_p) == (0.7, 0.9, 0.3, -0.1, 1.1, [0.7], 0.1)
    assert all(TOKENIZED_SCHEMA.field(n).type == pa.float64() for n in ("temperature", "top_p", "presence_penalty",
                                                                        "frequency_penalty", "repetition_penalty",
                                                                        "min_p"))


def test_a_value_its_arrow_type_cannot_hold_names_its_field() -> None:
    with pytest.raises(ValueError, match="top_k"):
        encode_request(Request("job_1", [1], top_k=3_000_000_000))
    with pytest.raises(ValueError, match="stop_token_ids"):
        encode_request(Request("job_1", [1], stop_token_ids=[2**40]))


def test_a_record_of_several_requests_is_refused() -> None:
    two = pa.RecordBatch.from_pylist([{n: getattr(r, n) for n in TOKENIZED_SCHEMA.names}
                                      for r in (Request("a", [1]), Request("b", [2]))], schema=TOKENIZED_SCHEMA)
    with pytest.raises(ValueError, match="one request"):
        decode_request(to_ipc(two))


def test_the_door_makes_the_engine_request() -> None:
    """What the API validated is what the engine receives: the floors applied once, a missing seed drawn once."""
    req = GenerationRequest(prompt="x", max_tokens=7, temperature=0.001, top_p=0.0001, seed=-1, stop="END",
                            stop_token_ids=[5], ignore_eos=True).tokenized("job_1", [1, 2])
    assert req == Request("job_1", [1, 2], max_tokens=7, temperature=0.0, top_p=0.001, seed=2**63 - 1, stop=["END"],
                          stop_token_ids=[5], ignore_eos=True)
    assert req.greedy
    # a missing seed is the job's: another for each job, the same each time a job is tokenized (again)
    seeds = {GenerationRequest(prompt="x").tokenized(f"job_{i}", [1]).seed for i in range(4)}
    assert len(seeds) == 4 and all(0 <= s < 2**63 for s in seeds)
    assert GenerationRequest(prompt="y").tokenized("job_0", [2]).seed in seeds


def test_the_wire_request_reads_back_as_the_door_made_it() -> None:
    """The tokenizer reads what the API wrote (exclude_defaults) without validating it again."""
    door = GenerationRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=9, temperature=0.7, seed=3,
                             stop="END", logit_bias={5: 2.5}, response_format={"type": "json_object"}, priority=2)
    back = GenerationRequest.from_wire(door.model_dump_json(exclude_defaults=True))
    assert back.model_dump() == door.model_dump()
    assert back.tokenized("j", [1]) == door.tokenized("j", [1])
    assert GenerationRequest.from_wire('{"prompt": "x"}').max_tokens == 256  # defaults filled


@pytest.mark.parametrize("raw", ["{not json", "[1, 2]", '{"prompt": "x", "unknown": 1}', "{}",
                                 '{"prompt": "x", "messages": [{"role": "user", "content": "y"}]}',
                                 '{"messages": [{"role": "user"}]}', '{"messages": 5}',
                                 '{"prompt": "x", "logit_bias": {"a": 1}}', '{"prompt": "x", "max_tokens": "many"}',
                                 '{"prompt": 5}', '{"prompt": "x", "temperature": "hot"}'])
def test_a_wire_request_of_the_wrong_shape_is_a_value_error(raw: str) -> None:
    with pytest.raises(ValueError):
        GenerationRequest.from_wire(raw)


def test_the_deployments_bounds_are_the_requests_own() -> None:
    deployment = Deployment(default_max_tokens=64, max_tokens_cap=100, max_prompt_chars=10, vocab_size=50)
    assert GenerationRequest(prompt="x").bounded(deployment).max_tokens == 64
    assert GenerationRequest(prompt="x", max_tokens=100).bounded(deployment).max_tokens == 100
    for fields, param, status in (({"prompt": "x", "max_tokens": 101}, "max_tokens", 422),
                                  ({"prompt": "x" * 11}, "prompt", 413),
                                  ({"messages": [{"role": "user", "content": "y" * 11}]}, "messages", 413),
                                  ({"prompt": "x", "top_k": 51}, "top_k", 422),
                                  ({"prompt": "x", "stop_token_ids": [50]}, "stop_token_ids", 422),
                                  ({"prompt": "x", "logit_bias": {50: 1}}, "logit_bias", 422),
                                  ({"prompt_token_ids": [1, 50]}, "prompt", 422)):
        with pytest.raises(LimitError) as err:
            GenerationRequest(**fields).bounded(deployment)  # type: ignore[arg-type]
        assert (err.value.param, err.value.status) == (param, status), fields
    assert GenerationRequest(prompt="x", top_k=50).bounded(Deployment()).top_k == 50  # vocabulary unknown


def test_the_engine_asserts_what_the_door_guarantees() -> None:
    assert GenerationRequest(prompt="x", temperature=1e-9, top_p=1e-9).tokenized("j", [1]).out_of_bounds() is None
    for bad in ({"temperature": 2.5}, {"temperature": 0.001}, {"temperature": float("nan")}, {"top_p": 0.0},
                {"top_p": float("nan")}, {"max_tokens": 0}, {"top_k": -1}, {"min_p": 1.5}, {"min_p": float("nan")},
                {"presence_penalty": float("inf")},
                {"repetition_penalty": 0.0}, {"bias_ids": [1], "bias_values": []},
                {"bias_ids": [1], "bias_values": [101.0]}, {"logprobs": 21}):
        problem = Request("j", [1], **bad).out_of_bounds()  # type: ignore[arg-type]
        assert problem and next(iter(bad)).split("_ids")[0] in problem, bad


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
