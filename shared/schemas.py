"""Messages between stages, defined once: the generation request the API validates (api -> tokenizer),
the `Request` it becomes once tokenized (tokenizer -> inference -> engine, its Arrow schema derived from
its fields), and the engine's token deltas (engine -> output lane)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, fields
from typing import Annotated, Any, Literal, get_args, get_origin, get_type_hints

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared.limits import (
    MAX_MESSAGES,
    Content,
    MaxTokens,
    Priority,
    Seed,
    StopList,
    StopTokenIds,
    Temperature,
    TopK,
    TopP,
    WebhookUrl,
    effective_temperature,
    effective_top_p,
)


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: Content


class SamplingParams(BaseModel):
    """Sampling controls with their bounds (shared.limits); temperature and top_p floors applied."""

    max_tokens: MaxTokens = 256
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    seed: Seed | None = None
    stop: StopList = Field(default_factory=list)
    stop_token_ids: StopTokenIds = Field(default_factory=list)
    ignore_eos: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: object) -> object:
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature_floor(cls, v: float) -> float:
        return effective_temperature(v)

    @field_validator("top_p")
    @classmethod
    def _top_p_floor(cls, v: float) -> float:
        return effective_top_p(v)


class GenerationRequest(SamplingParams):
    """What the API puts on the `jobs` stream: exactly one of `prompt` or `messages`."""

    model_config = ConfigDict(extra="forbid")
    prompt: Content | None = None
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    webhook_url: WebhookUrl | None = None  # POSTed the job once it ends
    priority: Priority = 0  # among its tenant's waiting jobs, lower runs first; ties by arrival

    @model_validator(mode="after")
    def _one_input(self) -> GenerationRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self

    def tokenized(self, job_id: str, prompt_ids: list[int]) -> Request:
        """This request as the engine receives it; a missing seed is drawn here, once."""
        sampling = self.model_dump(include=_SAMPLING)
        seed = self.seed % (1 << 63) if self.seed is not None else random.getrandbits(63)
        return Request(id=job_id, prompt_ids=prompt_ids, **{**sampling, "seed": seed})


_SAMPLING = set(SamplingParams.model_fields)
Int64 = Annotated[int, pa.int64()]  # Arrow width of an int field; a bare int is int32


@dataclass(slots=True)
class Request:
    """A generation request after the door and the tokenizer: token ids and the sampling controls,
    bounded and with their floors applied. One row of a `tokenized` batch (TOKENIZED_SCHEMA is derived
    from these fields) and what the engine schedules."""

    id: str
    prompt_ids: list[int]
    max_tokens: int = 256
    temperature: float = 1.0  # 0 is greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: Int64 = 0
    stop: list[str] = field(default_factory=list)  # matched on text by the output lane
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # tokens already generated elsewhere (a resumed job): prefilled after the prompt, not re-emitted;
    # set by the inference worker from the job record, never sent between stages
    resume_ids: list[int] = field(default_factory=list, metadata={"arrow": False})
    # the fair-queue tenant it is charged to ('' none): the engine gives a tenant that runs nothing a slot
    # (gpu_worker/engine/scheduler.py); set by the inference worker from the job record, never sent between stages
    tenant: str = field(default="", metadata={"arrow": False})

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


_ARROW_TYPES = {str: pa.string(), int: pa.int32(), float: pa.float32(), bool: pa.bool_()}


def _arrow_type(hint: Any) -> pa.DataType:
    if get_origin(hint) is Annotated:
        return get_args(hint)[1]
    if get_origin(hint) is list:
        return pa.list_(_arrow_type(get_args(hint)[0]))
    return _ARROW_TYPES[hint]


def arrow_schema(record: type) -> pa.Schema:
    """The Arrow schema of a dataclass's fields (those not marked `arrow: False`), none nullable."""
    hints = get_type_hints(record, include_extras=True)
    return pa.schema([pa.field(f.name, _arrow_type(hints[f.name]), nullable=False)
                      for f in fields(record) if f.metadata.get("arrow", True)])


# tokenizer -> inference: one row per job, many jobs per record batch.
TOKENIZED_SCHEMA = arrow_schema(Request)


def requests_batch(requests: list[Request]) -> pa.RecordBatch:
    """Requests as one `tokenized` record batch; raises if a value does not fit its Arrow type."""
    names = TOKENIZED_SCHEMA.names
    return pa.RecordBatch.from_pylist([{n: getattr(r, n) for n in names} for r in requests],
                                      schema=TOKENIZED_SCHEMA)


def batch_requests(batch: pa.RecordBatch) -> list[Request]:
    return [Request(**row) for row in batch.to_pylist()]

# engine -> output lane: one row per sequence that produced tokens or finished in a step.
DELTA_SCHEMA = pa.schema(
    [
        pa.field("job_id", pa.string(), nullable=False),
        pa.field("token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=True),
        pa.field("error", pa.string(), nullable=True),
    ]
)


def to_ipc(batch: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def from_ipc(data: bytes, schema: pa.Schema) -> pa.RecordBatch:
    reader = pa.ipc.open_stream(pa.py_buffer(data))
    if not reader.schema.equals(schema):
        raise ValueError(f"unexpected Arrow schema: {reader.schema}")
    table = reader.read_all()
    return table.combine_chunks().to_batches()[0] if table.num_rows else pa.RecordBatch.from_pylist([], schema)
