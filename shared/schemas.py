"""Messages between stages, defined once: the generation request the API validates (api -> tokenizer),
the `Request` it becomes once tokenized (tokenizer -> inference -> engine, its Arrow schema derived from
its fields), and the engine's token deltas (engine -> output lane)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, fields
from typing import Annotated, Any, Literal, get_args, get_origin, get_type_hints

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared.grammar import GrammarSpec, check, from_openai
from shared.limits import (
    MAX_MESSAGES,
    Content,
    LogitBias,
    Logprobs,
    MaxTokens,
    MinTokens,
    Penalty,
    Priority,
    PromptTokenIds,
    RepetitionPenalty,
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
    min_tokens: MinTokens = 0  # EOS and stop_token_ids cannot end the output before this many tokens
    presence_penalty: Penalty = 0.0  # subtracted once from the logit of every token the output holds
    frequency_penalty: Penalty = 0.0  # subtracted per occurrence in the output
    repetition_penalty: RepetitionPenalty = 1.0  # over prompt and output tokens: positive logits /, others *
    logit_bias: LogitBias = Field(default_factory=dict)  # token id -> added to its logit
    logprobs: bool = False  # each generated token's logprob (the model's log-softmax, before any sampling control)
    top_logprobs: Logprobs = 0  # and this many most likely alternatives per token (implies logprobs)
    prompt_logprobs: Logprobs | None = None  # each prompt token's logprob, with this many alternatives

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

    @model_validator(mode="after")
    def _min_within_max(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must not exceed max_tokens")
        return self


class Grammar(BaseModel):
    """Structured output, in its one canonical form (shared/grammar.py): what the output must match."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["json_schema", "json_object", "regex", "choice", "grammar"]
    source: str = ""

    @model_validator(mode="after")
    def _bounded(self) -> Grammar:
        check(GrammarSpec(self.kind, self.source))  # GrammarError is a ValueError: a 422 naming the field
        return self

    @property
    def spec(self) -> GrammarSpec:
        return GrammarSpec(self.kind, self.source)


# the ways clients ask for structured output (OpenAI's and vLLM's), all mapped onto `grammar`
GRAMMAR_PARAMS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                  "structured_outputs")


def grammar_of(params: dict[str, Any]) -> Grammar | None:
    """The grammar OpenAI's `response_format` or vLLM's `guided_*`/`structured_outputs` ask for (None: free
    text); GrammarError when they are invalid, conflict or exceed the bounds."""
    spec = from_openai(**{k: params.get(k) for k in GRAMMAR_PARAMS})
    return None if spec is None else Grammar(kind=spec.kind, source=spec.source)

class GenerationRequest(SamplingParams):
    """What the API puts on the `jobs` stream: exactly one of `prompt` or `messages`."""

    model_config = ConfigDict(extra="forbid")
    prompt: Content | None = None
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    prompt_token_ids: PromptTokenIds | None = None  # the prompt as token ids, used as given
    webhook_url: WebhookUrl | None = None  # POSTed the job once it ends
    priority: Priority = 0  # among its tenant's waiting jobs, lower runs first; ties by arrival
    grammar: Grammar | None = None  # structured output; `response_format` or vLLM's `guided_*` set it

    @model_validator(mode="before")
    @classmethod
    def _grammar_params(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(data.get(k) is not None for k in GRAMMAR_PARAMS):
            if data.get("grammar") is not None:
                raise ValueError("give either 'grammar' or one of " + ", ".join(GRAMMAR_PARAMS))
            data = dict(data)
            data["grammar"] = grammar_of(data)
            for k in GRAMMAR_PARAMS:
                data.pop(k, None)
        return data

    @model_validator(mode="after")
    def _one_input(self) -> GenerationRequest:
        if sum(x is not None for x in (self.prompt, self.messages, self.prompt_token_ids)) != 1:
            raise ValueError("give exactly one of 'prompt', 'messages' or 'prompt_token_ids'")
        return self

    def tokenized(self, job_id: str, prompt_ids: list[int]) -> Request:
        """This request as the engine receives it; a missing seed is drawn here, once."""
        sampling = self.model_dump(include=_SAMPLING)
        seed = self.seed % (1 << 63) if self.seed is not None else random.getrandbits(63)
        bias = sampling.pop("logit_bias")
        wants = sampling.pop("logprobs") or self.top_logprobs > 0
        prompt_lp = sampling.pop("prompt_logprobs")
        del sampling["top_logprobs"]
        g = self.grammar
        return Request(id=job_id, prompt_ids=prompt_ids, **{**sampling, "seed": seed},
                       logprobs=self.top_logprobs if wants else -1,
                       prompt_logprobs=-1 if prompt_lp is None else prompt_lp,
                       bias_ids=list(bias), bias_values=[float(v) for v in bias.values()],
                       grammar_kind=g.kind if g else "", grammar=g.source if g else "", priority=self.priority)


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
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    bias_ids: list[int] = field(default_factory=list)  # logit_bias, as parallel lists
    bias_values: list[float] = field(default_factory=list)
    logprobs: int = -1  # alternatives reported with each generated token's logprob; -1: no logprobs
    prompt_logprobs: int = -1  # the same for the prompt's tokens (echo)
    grammar_kind: str = ""  # structured output (shared/grammar.py); '' none
    grammar: str = ""  # its source, canonical
    # among its tenant's jobs, lower runs first: the fair queue's order, and the engine's (a running job of a worse
    # priority gives its slot; gpu_worker/engine/scheduler.py)
    priority: int = 0
    # tokens already generated elsewhere (a resumed job): prefilled after the prompt, not re-emitted;
    # set by the inference worker from the job record, never sent between stages
    resume_ids: list[int] = field(default_factory=list, metadata={"arrow": False})
    # the fair-queue tenant it is charged to ('' none): the engine gives a tenant that runs nothing a slot
    # (gpu_worker/engine/scheduler.py); set by the inference worker from the job record, never sent between stages
    tenant: str = field(default="", metadata={"arrow": False})
    # the grammar compiled (xgrammar's CompiledGrammar), attached by the inference worker's admission
    compiled_grammar: Any = field(default=None, metadata={"arrow": False})

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def shapes_logits(self) -> bool:
        """Whether anything changes its logits before sampling (penalties, bias, min_tokens, a grammar)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.bias_ids or self.min_tokens or self.grammar_kind)

    @property
    def grammar_spec(self) -> GrammarSpec | None:
        return GrammarSpec(self.grammar_kind, self.grammar) if self.grammar_kind else None


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

# engine -> output lane: one row per sequence that produced tokens or finished in a step. Logprobs, for the
# jobs that ask: per token the chosen token's and its top alternatives' (ids and logprobs, most likely first);
# the prompt's once, with the step that completes the prompt (its first token has none: not included).
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
