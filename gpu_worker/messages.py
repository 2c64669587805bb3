"""Every message between the inference worker's lanes, its engine loop and its output lane.

- engine loop inbox (a thread queue): `Add`, `Abort`, `GraceOver`
- output lane inbox (a process queue): `Register`, `Deltas`, `Stop`
- output lane reports (a process queue): `Abort`, `Done`, `Dropped`, `Ended`

Those crossing the process boundary pickle; only token-id deltas (Arrow, DELTA_SCHEMA) and job metadata cross it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from gpu_worker.engine import StepOutput
from shared.jobs import FinishReason
from shared.schemas import Request, from_ipc, to_ipc


@dataclass(frozen=True, slots=True)
class Add:
    """Start (or resume) a request in the engine."""
    request: Request


@dataclass(frozen=True, slots=True)
class Abort:
    """End a job in the engine: cancelled by the API, a stop string hit, or the output lane failed it."""
    job_id: str
    reason: FinishReason


@dataclass(frozen=True, slots=True)
class GraceOver:
    """The drain's grace period ended: hand back what is still running."""


@dataclass(frozen=True, slots=True)
class Register:
    """A job the output lane is to write: where its stream stands when this worker takes it."""
    job_id: str
    stop: tuple[str, ...]
    created_at: float  # 0: unknown
    prompt_tokens: int
    started: bool  # first start (not a resume): its time in the queue is observed
    seq: int = 0  # last event seq written
    resume_ids: tuple[int, ...] = ()  # tokens another worker generated and saved
    emitted: str = ""  # the text of those tokens already streamed
    tenant: str = ""  # the fair-queue tenant its tokens are charged to ('' none)
    weight: float = 1.0  # that tenant's weight
    logprob_bytes: int = 0  # bytes of logprob entries already recorded (a resumed job that asked for them)
    worker: str = ""  # the worker that took it (start.lua records it): its steps and end are written as that one's
    owner: str = ""  # the tenant that submitted it (start.lua's reply): its finish names that tenant's keys
    trace: str = ""  # its trace's carrier ('' not traced), and for its spans: when it was queued, taken here
    tokenize_at: float = 0.0
    tokenized_at: float = 0.0
    admitted_at: float = 0.0
    min_tokens: int = 0  # no stop string ends it before this many tokens
    include_stop: bool = False  # the stop string that ends it stays at its end


# One engine step, per job: its new token ids, its end (finish_reason, error), and, for jobs that ask, per token
# the chosen token's and its top alternatives' logprobs (ids and logprobs, most likely first); the prompt's once,
# with the step that completes the prompt (its first token has none: not included).
_TOP_IDS, _TOP_LPS = pa.list_(pa.list_(pa.int32())), pa.list_(pa.list_(pa.float32()))
DELTA_SCHEMA = pa.schema(
    [
        pa.field("job_id", pa.string(), nullable=False),
        pa.field("token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=True),
        pa.field("error", pa.string(), nullable=True),
        pa.field("logprobs", pa.list_(pa.float32()), nullable=True),
        pa.field("top_ids", _TOP_IDS, nullable=True),
        pa.field("top_logprobs", _TOP_LPS, nullable=True),
        pa.field("prompt_ids", pa.list_(pa.int32()), nullable=True),
        pa.field("prompt_logprobs", pa.list_(pa.float32()), nullable=True),
        pa.field("prompt_top_ids", _TOP_IDS, nullable=True),
        pa.field("prompt_top_logprobs", _TOP_LPS, nullable=True),
        pa.field("scheduled_at", pa.float64(), nullable=True),  # with a job's first row here
        # a traced job's engine events since its last row (StepOutput.timeline)
        pa.field("timeline", pa.list_(pa.struct([("event", pa.string()), ("at", pa.float64()),
                                                  ("tokens", pa.int32())])), nullable=True),
    ]
)


@dataclass(frozen=True, slots=True)
class Deltas:
    """One engine step's new token ids and ends, as an Arrow batch of DELTA_SCHEMA."""
    data: bytes

    @classmethod
    def of(cls, outs: list[StepOutput]) -> Deltas:
        batch = pa.RecordBatch.from_pylist([_row(o) for o in outs], schema=DELTA_SCHEMA)
        return cls(to_ipc(batch))

    def rows(self) -> list[dict[str, Any]]:
        """The step's rows, one per job, as dicts of DELTA_SCHEMA's fields."""
        return from_ipc(self.data, DELTA_SCHEMA).to_pylist()  # type: ignore[no-any-return]


def _row(o: StepOutput) -> dict[str, object]:
    reason = None if o.finish_reason is None else FinishReason(o.finish_reason).value
    row: dict[str, object] = {"job_id": o.id, "token_ids": o.token_ids, "finish_reason": reason, "error": o.error}
    if o.logprobs is not None:
        row.update(logprobs=o.logprobs.chosen, top_ids=o.logprobs.top_ids, top_logprobs=o.logprobs.top_lps)
    if o.scheduled_at:
        row["scheduled_at"] = o.scheduled_at
    if o.timeline:
        row["timeline"] = [{"event": e, "at": t, "tokens": n} for e, t, n in o.timeline]
    if o.prompt_logprobs is not None:
        row.update(prompt_ids=o.prompt_ids, prompt_logprobs=o.prompt_logprobs.chosen,
                   prompt_top_ids=o.prompt_logprobs.top_ids, prompt_top_logprobs=o.prompt_logprobs.top_lps)
    return row


@dataclass(frozen=True, slots=True)
class Stop:
    """Write what is pending and exit."""


@dataclass(frozen=True, slots=True)
class Done:
    """The job's end is recorded: its stream entry may be acknowledged once its batch-mates' are too."""
    job_id: str


@dataclass(frozen=True, slots=True)
class Ended:
    """The engine has finished the job, so its slot is free now; its end is being written (held while its master
    does not answer, `gpu_worker/backlog.py`; on a cluster, confirmed by a replica) before its `Done`."""
    job_id: str


@dataclass(frozen=True, slots=True)
class Dropped:
    """The job is no longer this worker's (its record is gone, or another worker runs it now): forget it and
    never acknowledge its entry, which may be another consumer's by now."""
    job_id: str


EngineCommand = Add | Abort | GraceOver
LaneCommand = Register | Deltas | Stop
LaneReport = Abort | Done | Dropped | Ended
