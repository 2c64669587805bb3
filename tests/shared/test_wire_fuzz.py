"""The tokenizer's reading of a `jobs` entry, fuzzed: whatever JSON an entry holds (a damaged entry, a writer of
another version), reading it, making its engine record and encoding that record either works or raises one of the
errors the tokenizer turns into that job's failure (workers/tokenizer/worker.py `_prepare`, `_record`). Nothing
else escapes, so no entry can stop a tokenizer, and a record that encodes decodes to the same request, whose
bounds check (`Request.out_of_bounds`, the engine's) answers rather than raises."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.schemas import GenerationRequest, decode_request, encode_request

FIELDS = sorted(GenerationRequest.model_fields)
# the errors the tokenizer fails a job with: from_wire's ValueError, then _record's
FAILS_ITS_JOB = (ArithmeticError, TypeError, ValueError)

scalars = st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) \
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8)
keys = st.sampled_from(["role", "content", "kind", "source", "1", "x"]) | st.text(max_size=3)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=3),
                      max_leaves=8)
# mostly the request's own fields (so most entries get past the shape check), sometimes others
entries = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=5), values, max_size=6)
# entries as the API writes them, then one field damaged
valid = st.fixed_dictionaries({"prompt": st.text(max_size=10)}, optional={
    "max_tokens": st.integers(1, 64), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
    "seed": st.integers(0, 2**63), "stop": st.text(max_size=3)})


def _read_as_the_tokenizer_does(raw: str) -> None:
    try:
        req = GenerationRequest.from_wire(raw)
    except ValueError:
        return  # the job fails: "invalid request"
    try:
        encoded = encode_request(req.tokenized("job_x", [1, 2, 3]))
    except FAILS_ITS_JOB:
        return
    back = decode_request(encoded)
    assert back.id == "job_x" and back.prompt_ids == [1, 2, 3]
    assert back.out_of_bounds() is None or isinstance(back.out_of_bounds(), str)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(entries)
def test_any_json_object_is_read_or_fails_its_job(entry: dict[str, Any]) -> None:
    _read_as_the_tokenizer_does(json.dumps(entry, allow_nan=True))


@settings(max_examples=300, deadline=None)
@given(valid, st.sampled_from(FIELDS), values)
def test_a_request_with_one_damaged_field_is_read_or_fails_its_job(entry: dict[str, Any], field: str,
                                                                   value: Any) -> None:
    _read_as_the_tokenizer_does(json.dumps({**entry, field: value}, allow_nan=True))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=40))
def test_any_bytes_are_read_or_fail_their_job(raw: bytes) -> None:
    try:
        GenerationRequest.from_wire(raw)
    except ValueError:
        pass
