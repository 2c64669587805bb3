"""Messages between stages: the generation request (api -> tokenizer) and the Arrow schemas
(tokenizer -> inference, engine -> output lane). Defined once, here."""

from __future__ import annotations

from typing import Annotated, Literal

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared.limits import (
    MAX_MESSAGES,
    Content,
    MaxTokens,
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

    @model_validator(mode="after")
    def _one_input(self) -> GenerationRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self


# tokenizer -> inference: one row per job, many jobs per record batch.
TOKENIZED_SCHEMA = pa.schema(
    [
        pa.field("job_id", pa.string(), nullable=False),
        pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("max_tokens", pa.int32(), nullable=False),
        pa.field("temperature", pa.float32(), nullable=False),
        pa.field("top_p", pa.float32(), nullable=False),
        pa.field("top_k", pa.int32(), nullable=False),
        pa.field("seed", pa.int64(), nullable=False),
        pa.field("stop", pa.list_(pa.string()), nullable=False),
        pa.field("stop_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("ignore_eos", pa.bool_(), nullable=False),
    ]
)

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
