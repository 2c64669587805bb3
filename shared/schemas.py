"""The request's records, defined once: the generation request the API validates (api -> tokenizer), and
the `Request` it becomes once tokenized (tokenizer -> inference -> engine, its Arrow schema derived from
its fields). The engine's token deltas to the output lane are the inference worker's own
(gpu_worker/messages.py)."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field, fields
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

import pyarrow as pa
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from shared.grammar import GrammarError, GrammarSpec, check, from_openai, tools_spec
from shared.grammar.tools import MAX_TOOLS, answer_of
from shared.limits import (
    BIAS_MAX,
    BIAS_MIN,
    MAX_LOGPROBS,
    MAX_MESSAGES,
    PENALTY_MAX,
    PENALTY_MIN,
    REPETITION_PENALTY_MAX,
    REPETITION_PENALTY_MIN,
    TEMPERATURE_FLOOR,
    TEMPERATURE_MAX,
    TOP_P_FLOOR,
    Content,
    Deployment,
    LimitError,
    LogitBias,
    Logprobs,
    MaxTokens,
    MinP,
    MinTokens,
    Name,
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
    shallow,
    webhook_port_refusal,
)


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: Name
    arguments: Content  # the arguments' JSON text (an object), as OpenAI carries it


class MessageToolCall(BaseModel):
    """A call an earlier assistant turn made (OpenAI's `tool_calls` item), rendered back into the prompt."""

    model_config = ConfigDict(extra="ignore")
    id: Name
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool"]
    content: Content
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=MAX_TOOLS)] | None = None  # an assistant's
    tool_call_id: Name | None = None  # a tool message's: the call it answers


class SamplingParams(BaseModel):
    """Sampling controls with their bounds (shared.limits); temperature and top_p floors applied."""

    max_tokens: MaxTokens = 256
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    min_p: MinP = 0.0  # vLLM's: drop tokens less likely than min_p times the most likely (0: off)
    seed: Seed | None = None
    stop: StopList = Field(default_factory=list)
    stop_token_ids: StopTokenIds = Field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: MinTokens = 0  # EOS and stop_token_ids cannot end the output before this many tokens
    include_stop_str_in_output: bool = False  # vLLM's: the stop string that ends the text stays at its end
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
        """(A max_tokens left out is the deployment's default, known at `bounded`, which checks again.)"""
        if "max_tokens" in self.model_fields_set and self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must not exceed max_tokens")
        return self


class Grammar(BaseModel):
    """Structured output, in its one canonical form (shared/grammar/): what the output must match."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["json_schema", "json_object", "regex", "choice", "grammar", "tool_calls"]
    source: str = ""

    @model_validator(mode="after")
    def _bounded(self) -> Grammar:
        check(GrammarSpec(self.kind, self.source))  # GrammarError is a ValueError: a 422 naming the field
        return self

    @property
    def spec(self) -> GrammarSpec:
        return GrammarSpec(self.kind, self.source)


# the ways clients ask for structured output (OpenAI's and vLLM's), all mapped onto `grammar`
# The API cannot tokenize: a prompt is reserved against a tenant's tokens per minute at this many characters a
# token (most tokenizers give 3-4 for English), and the difference refunded when the job ends (`reserved_tokens`)
CHARS_PER_TOKEN = 3
GRAMMAR_PARAMS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                  "structured_outputs")


def grammar_of(params: dict[str, Any]) -> Grammar | None:
    """The grammar OpenAI's `response_format` or vLLM's `guided_*`/`structured_outputs` ask for (None: free
    text); GrammarError when they are invalid, conflict or exceed the bounds."""
    spec = from_openai(**{k: params.get(k) for k in GRAMMAR_PARAMS})
    return None if spec is None else Grammar(kind=spec.kind, source=spec.source)

class GenerationRequest(SamplingParams):
    """What the API puts on the `jobs` stream: exactly one of `prompt` or `messages`. With `tools` (OpenAI's
    function tools) and a `tool_choice` other than none, the tools reach the prompt (the tokenizer's tool
    template) and `grammar` holds every call to a declared tool's schema (shared/grammar/tools.py)."""

    model_config = ConfigDict(extra="forbid")
    # the model it runs on: a served model's name, or a LoRA adapter's (shared/lora.py); None the default model.
    # The door checks it (404 model_not_found) and leaves only an adapter's name here, its base in `base_model`
    model: Name | None = None
    # the model whose queue and pool run it, when not the default (shared/served.py): the door sets it, whatever a
    # client sent (api/models.py `Target.apply`)
    base_model: SkipJsonSchema[Name | None] = None
    # max_tokens was left out: the deployment's default, lowered to what the context leaves after the prompt rather
    # than refused (vLLM's); the door sets it, whatever a client sent (`bounded`)
    max_tokens_defaulted: SkipJsonSchema[bool] = False
    prompt: Content | None = None
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    prompt_token_ids: PromptTokenIds | None = None  # the prompt as token ids, used as given
    webhook_url: WebhookUrl | None = None  # POSTed the job once it ends
    priority: Priority = 0  # among its tenant's waiting jobs, lower runs first; ties by arrival
    grammar: Grammar | None = None  # structured output; `response_format` or vLLM's `guided_*` set it
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS), AfterValidator(shallow)] | None = None
    tool_choice: str | dict[str, Any] | None = None  # none, auto (the default with tools), required, or a name
    parallel_tool_calls: bool = True  # false: the output ends after its first call
    # vLLM's: the last message, an assistant's, is continued (its turn left open) instead of answered
    continue_final_message: bool = False
    # OpenAI Responses': with `messages`, `auto` drops the oldest turns (after the leading system messages; never the
    # last) until the prompt and max_tokens fit the model's context (the tokenizer pool: the API never tokenizes)
    truncation: Literal["disabled", "auto"] = "disabled"

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
        _one_of(self.prompt, self.messages, self.prompt_token_ids)
        return self

    @model_validator(mode="after")
    def _continued(self) -> GenerationRequest:
        if self.continue_final_message and not (self.messages and self.messages[-1].role == "assistant"
                                                and not self.messages[-1].tool_calls):
            raise ValueError("messages: continue_final_message needs a last message from the assistant, with text")
        return self

    @model_validator(mode="after")
    def _tool_grammar(self) -> GenerationRequest:
        """`tools` and `tool_choice` as the `tool_calls` grammar (GrammarError, a ValueError, naming the
        parameter at fault); a conversation's tool turns answer calls it made."""
        check_tool_turns(self.messages or [])
        if self.tools is None and self.tool_choice is None:
            return self
        if self.prompt is not None or self.prompt_token_ids is not None:
            raise GrammarError("tools: tools need 'messages' (a raw prompt has no tool template)")
        answer = None  # the structured output beside the tools (kept when validated again)
        if self.grammar is not None:
            answer = answer_of(self.grammar.source) if self.grammar.kind == "tool_calls" else self.grammar.spec
        spec = tools_spec(self.tools, self.tool_choice, self.parallel_tool_calls, answer)
        if spec is not None:
            try:
                check(spec)
            except GrammarError as exc:
                message = str(exc)
                raise GrammarError(message if message.startswith("tools") else f"tools: {message}") from None
            self.grammar = Grammar.model_construct(kind="tool_calls", source=spec.source)
        return self

    @property
    def calls_tools(self) -> bool:
        """Whether its output may hold tool calls (read out by TOOL_CALL_PARSER)."""
        return self.grammar is not None and self.grammar.kind == "tool_calls"

    @property
    def prompt_tools(self) -> list[dict[str, Any]] | None:
        """The tools the prompt shows: none when tool_choice is none."""
        return self.tools if self.calls_tools else None

    def prompt_chars(self) -> int:
        """The characters of its prompt text: messages (tool calls' arguments too) and the tools it shows."""
        return prompt_chars(self.prompt, self.messages, self.prompt_tools)

    def bounded(self, deployment: Deployment) -> GenerationRequest:
        """This request within the deployment's bounds, its max_tokens defaulted when it gave none; LimitError
        (a 413 for too much prompt text, a 422 otherwise, naming the field) when it is not."""
        self.max_tokens_defaulted = "max_tokens" not in self.model_fields_set
        if self.max_tokens_defaulted:
            self.max_tokens = deployment.default_max_tokens
        if self.max_tokens > deployment.max_tokens_cap:
            raise LimitError(f"max_tokens must be at most {deployment.max_tokens_cap}", "max_tokens")
        if self.min_tokens > self.max_tokens:  # (again: max_tokens may be the deployment's default only now)
            raise LimitError(f"min_tokens must not exceed max_tokens ({self.max_tokens})", "min_tokens")
        size = self.prompt_chars()
        if size > deployment.max_prompt_chars:
            raise LimitError(f"the prompt has {size} characters; the limit is {deployment.max_prompt_chars}",
                             "messages" if self.messages else "prompt", status=413)
        if self.webhook_url and (why := webhook_port_refusal(self.webhook_url, deployment.webhook_ports)):
            raise LimitError(f"webhook_url: {why}", "webhook_url")
        vocab = deployment.vocab_size
        if vocab is None:
            return self
        if self.top_k > vocab:
            raise LimitError(f"top_k must be 0 (off) or at most the vocabulary size, {vocab}", "top_k")
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", list(self.logit_bias)),
                          ("prompt", self.prompt_token_ids or [])):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise LimitError(f"{name}: token ids must be below the vocabulary size {vocab}; got {bad}", name)
        return self

    @classmethod
    def from_wire(cls, raw: str | bytes) -> GenerationRequest:
        """A request as the API puts it on the `jobs` stream (`model_dump_json(exclude_defaults=True)` of one the
        door validated), read without validating it again: only its shape is checked (a JSON object of this
        model's fields, one input), ValueError otherwise. A value of the wrong type fails its job further on
        (tokenizing it, encoding its `Request`), and the engine asserts the bounds (`Request.out_of_bounds`)."""
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("the request is not a JSON object")
        unknown = data.keys() - cls.model_fields.keys()
        if unknown:
            raise ValueError(f"unknown fields: {', '.join(sorted(unknown))}")
        mistyped = [name for name, value in data.items() if not isinstance(value, _WIRE_TYPES[name])]
        if mistyped:
            raise ValueError(f"{', '.join(mistyped)}: not of the field's type")
        try:
            _one_of(data.get("prompt"), data.get("messages"), data.get("prompt_token_ids"))
            if data.get("messages") is not None:
                data["messages"] = [_wire_message(m) for m in data["messages"]]
            if data.get("grammar") is not None:
                g = data["grammar"]
                data["grammar"] = Grammar.model_construct(kind=g["kind"], source=g.get("source", ""))
            if data.get("logit_bias"):
                data["logit_bias"] = {int(k): v for k, v in data["logit_bias"].items()}
        except (TypeError, LookupError, AttributeError) as exc:
            raise ValueError(f"the request has an unexpected shape ({type(exc).__name__}: {exc})") from None
        return cls.model_construct(**data)

    def reserved_tokens(self) -> int:
        """What the job reserves of its tenant's tokens per minute at submit, before it is tokenized: its prompt
        at CHARS_PER_TOKEN characters a token (token ids as they are), plus max_tokens."""
        chars = self.prompt_chars()
        return len(self.prompt_token_ids or []) + math.ceil(chars / CHARS_PER_TOKEN) + self.max_tokens

    def tokenized(self, job_id: str, prompt_ids: list[int]) -> Request:
        """This request as the engine receives it; a missing seed is the job's own (`job_seed`)."""
        sampling = self.model_dump(include=_SAMPLING, warnings=False)  # (a wire request is not validated again)
        seed = self.seed % (1 << 63) if self.seed is not None else job_seed(job_id)
        bias = sampling.pop("logit_bias")
        wants = sampling.pop("logprobs") or self.top_logprobs > 0
        prompt_lp = sampling.pop("prompt_logprobs")
        del sampling["top_logprobs"]
        g = self.grammar
        return Request(id=job_id, prompt_ids=prompt_ids, **{**sampling, "seed": seed},
                       logprobs=self.top_logprobs if wants else -1,
                       prompt_logprobs=-1 if prompt_lp is None else prompt_lp,
                       bias_ids=list(bias), bias_values=[float(v) for v in bias.values()],
                       grammar_kind=g.kind if g else "", grammar=g.source if g else "", priority=self.priority,
                       lora=self.model or "")


def prompt_chars(prompt: str | None, messages: list[Message] | None, tools: list[dict[str, Any]] | None) -> int:
    """The characters of a prompt's text (what MAX_PROMPT_CHARS bounds): the prompt, or the messages (tool calls'
    names and arguments too), and the tools it shows."""
    chars = len(prompt or "")
    for m in messages or []:
        chars += len(m.content) + sum(len(c.function.arguments) + len(c.function.name) for c in m.tool_calls or [])
    return chars + (len(json.dumps(tools)) if tools else 0)


def job_seed(job_id: str) -> int:
    """The seed of a job whose request names none: drawn from its id (random, and each choice a job of its own), so
    that the job tokenized again (its tokenizer died before acknowledging it; a failover lost its queue entry) samples
    the same tokens, rather than splice another generation onto what its client already has."""
    return int.from_bytes(hashlib.blake2b(job_id.encode(), digest_size=8).digest(), "big") >> 1


def _wire_message(m: dict[str, Any]) -> Message:
    calls = m.get("tool_calls")
    if calls is not None:
        calls = [MessageToolCall.model_construct(id=c["id"], function=CalledFunction.model_construct(
            name=c["function"]["name"], arguments=c["function"]["arguments"])) for c in calls]
    return Message.model_construct(role=m["role"], content=m["content"], tool_calls=calls,
                                   tool_call_id=m.get("tool_call_id"))


def check_tool_turns(messages: list[Message]) -> None:
    """Tool turns in order: an assistant's calls have ids of their own and arguments that are JSON objects (or ""); a
    tool message answers one of the calls before it. GrammarError naming the message at fault."""
    called: set[str] = set()
    for i, m in enumerate(messages):
        if m.tool_calls and m.role != "assistant":
            raise GrammarError(f"messages[{i}].tool_calls: only an assistant message makes tool calls")
        for j, call in enumerate(m.tool_calls or []):
            try:  # ("" is how some clients write a call without arguments: {}, as the prompt renders it)
                args = json.loads(call.function.arguments) if call.function.arguments.strip() else {}
            except ValueError:
                args = None
            if not isinstance(args, dict):
                raise GrammarError(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object's text")
            called.add(call.id)
        if m.role == "tool":
            if m.tool_call_id is None:
                raise GrammarError(f"messages[{i}].tool_call_id: a tool message names the call it answers")
            if m.tool_call_id not in called:
                raise GrammarError(f"messages[{i}].tool_call_id: {m.tool_call_id!r} answers no earlier tool call")


def _json_types(annotation: Any) -> tuple[type, ...]:
    """The Python types a field's JSON value may have (bounds aside): the wire request's cheap shape check."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _json_types(get_args(annotation)[0])
    if origin in (Union, UnionType):
        return tuple(t for arg in get_args(annotation) for t in _json_types(arg))
    if annotation is float:
        return (int, float)
    if origin is Literal:  # its values' types (which value it holds is the API's to have checked)
        return tuple({type(value) for value in get_args(annotation)})
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return (dict,)
    return (origin or annotation,)


_WIRE_TYPES = {name: _json_types(f.annotation) for name, f in GenerationRequest.model_fields.items()}


def _one_of(*inputs: object) -> None:
    if sum(x is not None for x in inputs) != 1:
        raise ValueError("give exactly one of 'prompt', 'messages' or 'prompt_token_ids'")


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
    min_p: float = 0.0
    seed: Int64 = 0
    stop: list[str] = field(default_factory=list)  # matched on text by the output lane
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False  # for the output lane
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
    # its trace's carrier (shared/tracing.py; '' when not traced), and when the tokenizer pool began tokenizing it
    # and queued it (unix s): its record keeps them once it ends (the dashboard's timeline)
    trace: str = ""
    tokenize_at: float = 0.0
    tokenized_at: float = 0.0
    # the LoRA adapter it runs with ('' the base model alone): the name a request gave as `model` (shared/lora.py)
    lora: str = ""
    # that adapter's directory, resolved by the inference worker's admission; never sent between stages
    lora_path: str = field(default="", metadata={"arrow": False})
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

    def out_of_bounds(self) -> str | None:
        """Which bound the door guarantees (shared.limits, the floors applied) this request breaks, None when
        it keeps them all: a cheap assertion for a record that crossed processes. NaN fails every comparison."""
        t, bias = self.temperature, zip(self.bias_ids, self.bias_values, strict=False)
        holds = {
            "max_tokens": self.max_tokens >= 1,
            "temperature": t == 0 or TEMPERATURE_FLOOR <= t <= TEMPERATURE_MAX,
            "top_p": TOP_P_FLOOR <= self.top_p <= 1.0,
            "top_k": self.top_k >= 0,
            "min_p": 0.0 <= self.min_p <= 1.0,
            "min_tokens": self.min_tokens >= 0,
            "presence_penalty": PENALTY_MIN <= self.presence_penalty <= PENALTY_MAX,
            "frequency_penalty": PENALTY_MIN <= self.frequency_penalty <= PENALTY_MAX,
            "repetition_penalty": REPETITION_PENALTY_MIN <= self.repetition_penalty <= REPETITION_PENALTY_MAX,
            "logit_bias": len(self.bias_ids) == len(self.bias_values)
                          and all(i >= 0 and BIAS_MIN <= v <= BIAS_MAX for i, v in bias),
            "logprobs": -1 <= self.logprobs <= MAX_LOGPROBS,
            "prompt_logprobs": -1 <= self.prompt_logprobs <= MAX_LOGPROBS,
        }
        bad = next((name for name, ok in holds.items() if not ok), None)
        return None if bad is None else f"{bad} is out of its bounds"


# Arrow widths of the fields' types: every float a client sends travels as float64, so 0.7 arrives as 0.7
_ARROW_TYPES = {str: pa.string(), int: pa.int32(), float: pa.float64(), bool: pa.bool_()}


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


# tokenizer -> inference: one job per record, a one-row Arrow IPC stream.
TOKENIZED_SCHEMA = arrow_schema(Request)


def encode_request(req: Request) -> bytes:
    """The request as its `tokenized` record; ValueError naming the field whose value its Arrow type cannot hold."""
    columns = []
    for f in TOKENIZED_SCHEMA:
        try:
            columns.append(pa.array([getattr(req, f.name)], type=f.type))
        except (pa.ArrowException, OverflowError, TypeError, ValueError) as exc:
            raise ValueError(f"{f.name} does not fit its type ({exc})") from None
    return to_ipc(pa.RecordBatch.from_arrays(columns, schema=TOKENIZED_SCHEMA))


def decode_request(data: bytes) -> Request:
    """The request a `tokenized` record holds; ValueError when it is not one such record."""
    batch = from_ipc(data, TOKENIZED_SCHEMA)
    if batch.num_rows != 1:
        raise ValueError(f"a tokenized record holds one request, this one {batch.num_rows}")
    return Request(**batch.to_pylist()[0])


def to_ipc(batch: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    data: bytes = sink.getvalue().to_pybytes()
    return data


def from_ipc(data: bytes, schema: pa.Schema) -> pa.RecordBatch:
    reader = pa.ipc.open_stream(pa.py_buffer(data))
    if not reader.schema.equals(schema):
        raise ValueError(f"unexpected Arrow schema: {reader.schema}")
    table = reader.read_all()
    return table.combine_chunks().to_batches()[0] if table.num_rows else pa.RecordBatch.from_pylist([], schema)
