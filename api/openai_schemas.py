"""OpenAI-compatible request bodies, mapped onto the one generation request conveyor runs.

Options conveyor does not implement are refused with a 400 in OpenAI's error format rather
than silently ignored."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api.errors import ApiError
from shared.limits import (
    MAX_MESSAGES,
    Content,
    MaxTokens,
    Name,
    Priority,
    Seed,
    StopList,
    StopString,
    StopTokenIds,
    Temperature,
    TopK,
    TopP,
)
from shared.schemas import GenerationRequest, Message


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: Name | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    stop: StopString | StopList | None = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Name | None = None
    n: int = 1
    logprobs: Any = None
    top_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    stop_token_ids: StopTokenIds | None = None
    priority: Priority = 0  # vLLM's: among the tenant's waiting jobs, lower runs first

    # accepted and harmless: they change nothing about the text
    _IGNORED = {"metadata", "store", "service_tier", "parallel_tool_calls", "prediction", "modalities",
                "reasoning_effort", "verbosity", "web_search_options", "safety_identifier", "prompt_cache_key"}

    def refuse_unsupported(self) -> None:
        def no(param: str, why: str) -> None:
            raise ApiError(400, why, param=param)

        if self.n != 1:
            no("n", "only n=1 is supported")
        if self.logprobs not in (None, False) or self.top_logprobs:
            no("logprobs", "logprobs are not supported")
        if self.presence_penalty or self.frequency_penalty:
            no("presence_penalty" if self.presence_penalty else "frequency_penalty", "penalties are not supported")
        if self.logit_bias:
            no("logit_bias", "logit_bias is not supported")
        for name in self.model_extra or {}:
            if name not in self._IGNORED and name not in ("max_completion_tokens", "echo", "suffix", "best_of"):
                no(name, f"unsupported parameter: {name}")

    def sampling(self, max_tokens: int | None) -> dict[str, Any]:
        out: dict[str, Any] = {"stop": self.stop, "ignore_eos": self.ignore_eos, "priority": self.priority}
        for name in ("temperature", "top_p", "top_k", "seed", "stop_token_ids"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if max_tokens is not None:
            out["max_tokens"] = max_tokens
        return out


class ContentPart(BaseModel):
    type: Name
    text: Content | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | Annotated[list[ContentPart], Field(max_length=64)] | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: MaxTokens | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None

    def to_generation(self) -> GenerationRequest:
        self.refuse_unsupported()
        if self.tools or self.functions or self.tool_choice not in (None, "none") or self.function_call:
            raise ApiError(400, "tools and function calling are not supported", param="tools")
        if self.response_format and self.response_format.get("type") != "text":
            raise ApiError(400, "only response_format type 'text' is supported", param="response_format")
        messages = []
        for i, m in enumerate(self.messages):
            if m.role == "tool":
                raise ApiError(400, "tool messages are not supported", param=f"messages.{i}")
            if isinstance(m.content, list):
                if any(p.type != "text" for p in m.content):
                    raise ApiError(400, "only text content parts are supported", param=f"messages.{i}.content")
                text = "".join(p.text or "" for p in m.content)
            else:
                text = m.content or ""
            messages.append(Message(role="system" if m.role == "developer" else m.role, content=text))
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return _generation(messages=messages, **self.sampling(limit))


class CompletionRequest(_Common):
    prompt: Content | Annotated[list[Content], Field(max_length=1)]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def to_generation(self) -> GenerationRequest:
        self.refuse_unsupported()
        if self.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        if self.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")
        if self.best_of not in (None, 1):
            raise ApiError(400, "only best_of=1 is supported", param="best_of")
        prompt = self.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise ApiError(400, "send one prompt per request", param="prompt")
            prompt = prompt[0]
        return _generation(prompt=prompt, **self.sampling(self.max_tokens))


def _generation(**fields: Any) -> GenerationRequest:
    """Fields already hold their bounds; what is left (joined content parts too long, say) is a 422."""
    try:
        return GenerationRequest(**fields)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ()))
        raise ApiError(422, f"{where}: {err.get('msg', 'invalid')}", param=where or None) from None
