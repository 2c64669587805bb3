"""The engine loop's deltas to the output lane (gpu_worker/messages.py): a step's rows round-trip through Arrow,
and a `FinishReason` comes back as the same reason, so what the lane compares and records stays as before."""

from __future__ import annotations

import pyarrow as pa
import pytest

from gpu_worker.engine import StepOutput
from gpu_worker.messages import DELTA_SCHEMA, Deltas
from shared.jobs import FinishReason
from shared.schemas import TOKENIZED_SCHEMA, from_ipc, to_ipc


def test_an_engine_finish_reason_reaches_the_output_lane_as_itself() -> None:
    outs = [StepOutput("a", [1], FinishReason.stop), StepOutput("b", [], FinishReason.error, error="boom"),
            StepOutput("c", [2, 3], FinishReason.length), StepOutput("d", [], FinishReason.cancelled),
            StepOutput("e", [4])]
    rows = list(Deltas.of(outs).rows())
    assert [row["finish_reason"] for row in rows] == ["stop", "error", "length", "cancelled", None]
    assert [FinishReason(row["finish_reason"]) for row in rows[:4]] == [o.finish_reason for o in outs[:4]]
    assert rows[1]["error"] == "boom"


def test_delta_batch_round_trips_and_schema_is_checked() -> None:
    rows = [{"job_id": "a", "token_ids": [1, 2], "finish_reason": None, "error": None},
            {"job_id": "b", "token_ids": [], "finish_reason": "error", "error": "boom"}]
    data = to_ipc(pa.RecordBatch.from_pylist(rows, schema=DELTA_SCHEMA))
    assert [{k: v for k, v in r.items() if v is not None or k in ("finish_reason", "error")}
            for r in from_ipc(data, DELTA_SCHEMA).to_pylist()] == rows
    with pytest.raises(ValueError):
        from_ipc(data, TOKENIZED_SCHEMA)
