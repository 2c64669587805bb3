"""OpenAI-compatible request bodies, mapped onto the generation requests conveyor runs: one per prompt
(a completions request may carry several), each run once per choice (`n`).

Options conveyor does not implement are refused with a 400 in OpenAI's error format rather
than silently ignored."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from api.errors import ApiError
from shared.grammar import GrammarError
from shared.grammar.tools import MAX_TOOLS
from shared.limits import (
    MAX_CHOICES,
    MAX_MESSAGES,
    MAX_PROMPT_JOBS,
    MAX_PROMPTS,
    Content,
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
    StopString,
    StopTokenIds,
    Temperature,
    TopK,
    TopP,
    shallow,
)
from shared.schemas import GRAMMAR_PARAMS, GenerationRequest, Grammar, Message, grammar_of


class ClientBody(BaseModel):
    """A client's request body, as OpenAI's and Anthropic's APIs read one: JSON null for a field that is not
    required means the field's default (SDKs send a None they are given); a required field's null is refused."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}


class StreamOptions(ClientBody):
    include_usage: bool = False


class _Common(ClientBody):
    model_config = ConfigDict(extra="allow")
    model: Name | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None  # vLLM's
    stop: StopString | StopList | None = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Name | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0  # vLLM's
    logit_bias: LogitBias | None = None
    min_tokens: MinTokens = 0  # vLLM's
    include_stop_str_in_output: bool = False  # vLLM's
    ignore_eos: bool = False
    stop_token_ids: StopTokenIds | None = None
    priority: Priority = 0  # vLLM's: among the tenant's waiting jobs, lower runs first
    # structured output: OpenAI's response_format, or vLLM's guided_* / structured_outputs (one of them)
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[Any] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    # accepted and harmless: they change nothing about the text
    _IGNORED = {"metadata", "store", "service_tier", "parallel_tool_calls", "prediction", "modalities",
                "reasoning_effort", "verbosity", "web_search_options", "safety_identifier", "prompt_cache_key",
                "guided_decoding_backend", "guided_whitespace_pattern"}

    def refuse_unsupported(self) -> None:
        """400 for a parameter this service does not take, and for stream_options without stream (OpenAI's and
        vLLM's: it would be taken and ignored)."""
        for name in self.model_extra or {}:
            if name not in self._IGNORED:
                raise ApiError(400, f"unsupported parameter: {name}", param=name)
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")

    def grammar(self) -> Grammar | None:
        """The structured output asked for; a bad or oversized schema, regex or grammar answers 400."""
        try:
            return grammar_of({k: getattr(self, k) for k in GRAMMAR_PARAMS})
        except (GrammarError, ValidationError) as exc:
            param = next((k for k in GRAMMAR_PARAMS if getattr(self, k) is not None), "response_format")
            raise ApiError(400, f"invalid structured output: {_message(exc)}", param=param) from None

    def sampling(self, max_tokens: int | None) -> dict[str, Any]:
        out: dict[str, Any] = {"stop": self.stop, "ignore_eos": self.ignore_eos, "priority": self.priority,
                               "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                               "repetition_penalty": self.repetition_penalty, "logit_bias": self.logit_bias or {},
                               "min_tokens": self.min_tokens, "grammar": self.grammar(),
                               "include_stop_str_in_output": self.include_stop_str_in_output}
        for name in ("temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if max_tokens is not None:
            out["max_tokens"] = max_tokens
        return out


def _message(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return "; ".join(str(e.get("msg", "invalid")).removeprefix("Value error, ") for e in exc.errors())
    return str(exc)


class ContentPart(BaseModel):
    type: Name
    text: Content | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | Annotated[list[ContentPart], Field(max_length=64)] | None = None
    tool_calls: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None  # an assistant's
    tool_call_id: Name | None = None  # a tool message's: the call it answers

    def to_message(self, i: int) -> Message:
        """This message as the job's (text parts joined by newlines, as vLLM joins them for a template of string
        content); 400 naming it when it holds what cannot be."""
        if isinstance(self.content, list):
            if any(p.type != "text" for p in self.content):
                raise ApiError(400, "only text content parts are supported", param=f"messages.{i}.content")
            text = "\n".join(p.text or "" for p in self.content)
        else:
            text = self.content or ""
        role = "system" if self.role == "developer" else self.role
        try:
            return Message(role=role, content=text, tool_calls=self.tool_calls, tool_call_id=self.tool_call_id)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(x) for x in err.get("loc", ()))
            raise ApiError(400, f"messages.{i}.{where}: {err.get('msg', 'invalid')}",
                           param=f"messages.{i}.{where}") from None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: MaxTokens | None = None
    tools: Annotated[list[Any], Field(max_length=MAX_TOOLS), AfterValidator(shallow)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    functions: list[Any] | None = None
    function_call: Any = None
    logprobs: bool | None = None
    top_logprobs: Logprobs | None = None
    continue_final_message: bool = False  # vLLM's: the last (assistant) message is continued

    def to_generation(self) -> list[GenerationRequest]:
        """The one generation request the chat asks for (each of its `n` choices runs it)."""
        self.refuse_unsupported()
        if self.functions or self.function_call:
            raise ApiError(400, "functions and function_call are deprecated and not supported: send tools and "
                                "tool_choice", param="functions" if self.functions else "function_call")
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        messages = [m.to_message(i) for i, m in enumerate(self.messages)]
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return [_generation(messages=messages, logprobs=bool(self.logprobs), top_logprobs=self.top_logprobs or 0,
                            tools=self.tools, tool_choice=self.tool_choice,
                            parallel_tool_calls=self.parallel_tool_calls,
                            continue_final_message=self.continue_final_message, **self.sampling(limit))]


Prompts = Annotated[list[Content], Field(min_length=1, max_length=MAX_PROMPTS)]
TokenPrompts = Annotated[list[PromptTokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]


class CompletionRequest(_Common):
    # a string, strings, token ids, or lists of token ids: one choice (times n) per prompt
    prompt: Content | Prompts | PromptTokenIds | TokenPrompts
    echo: bool = False  # the prompt precedes the completion in `text` (and in logprobs, with its own)
    logprobs: Logprobs | None = None
    suffix: str | None = None
    best_of: int | None = None

    def to_generation(self) -> list[GenerationRequest]:
        """One generation request per prompt (each of its `n` choices runs it)."""
        self.refuse_unsupported()
        if self.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise ApiError(400, "best_of must equal n (choices are not ranked)", param="best_of")
        p = self.prompt
        prompts: list[dict[str, Any]]
        if isinstance(p, str):
            prompts = [{"prompt": p}]
        elif p and isinstance(p[0], int):
            prompts = [{"prompt_token_ids": p}]
        else:
            prompts = [{"prompt_token_ids": x} if isinstance(x, list) else {"prompt": x} for x in p]
        if len(prompts) * self.n > MAX_PROMPT_JOBS:
            raise ApiError(400, f"prompts x n must be at most {MAX_PROMPT_JOBS}; got {len(prompts) * self.n}",
                           param="prompt")
        lp = {"logprobs": self.logprobs is not None, "top_logprobs": self.logprobs or 0}
        if self.echo and (self.logprobs is not None or any("prompt_token_ids" in one for one in prompts)):
            lp["prompt_logprobs"] = self.logprobs or 0  # (also how a prompt of token ids gets its text back)
        sampling = self.sampling(self.max_tokens)
        return [_generation(**one, **lp, **sampling) for one in prompts]


def _generation(**fields: Any) -> GenerationRequest:
    """Fields already hold their bounds; a rule across fields (tools, tool turns, structured output) broken is a
    400 naming the parameter, what is left (joined content parts too long, say) the field's refusal (a 400 on these
    routes, api/errors.py)."""
    try:
        return GenerationRequest(**fields)
    except ValidationError as exc:
        raise request_error(exc) from None


def request_error(exc: ValidationError) -> ApiError:
    """A GenerationRequest's refusal as the API answers it: a field's bound a 422 naming it (a 400 but on
    /v1/jobs: api/errors.py), a rule across fields a 400 naming the parameter its message begins with."""
    err = exc.errors()[0]
    where = ".".join(str(x) for x in err.get("loc", ()))
    message = str(err.get("msg", "invalid"))
    if where:
        return ApiError(422, f"{where}: {message}", param=where)
    message = message.removeprefix("Value error, ")
    named = _PARAM.match(message)
    return ApiError(400, message, param=named.group(0) if named else None)


# the parameter a cross-field rule's message begins with (shared/schemas.py, shared/grammar/tools.py)
_PARAM = re.compile(r"(tools|tool_choice|messages)(\[\d+\])?(\.\w+(\[\d+\])?)*")


Order = Literal["asc", "desc"]  # a list's `order` query parameter: oldest or newest first


def list_page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's cursor-paginated list: `data` with its first and last ids."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}
