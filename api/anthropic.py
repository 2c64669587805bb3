"""Anthropic's Messages API on the job path: its request bodies (mapped onto one `GenerationRequest`), its
`message` object, and its stream's events (`message_start` ... `message_stop`, `error`), framed as Anthropic
sends them.

Tool use is not offered yet: `refuse_tools` is the one place that says so (400 naming the parameter)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api import sse
from api.errors import ApiError, anthropic_body
from shared.jobs import FinishReason, Job
from shared.limits import MAX_MESSAGES, Content, MaxTokens, Name, StopList, Temperature, TopK, TopP
from shared.schemas import GenerationRequest, Message

MAX_BLOCKS = 256  # content blocks in one message, or in `system`


class ContentBlock(BaseModel):
    model_config = ConfigDict(extra="allow")  # cache_control, citations: accepted, they change no text
    type: Name
    text: Content | None = None


Blocks = Annotated[list[ContentBlock], Field(max_length=MAX_BLOCKS)]


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: Content | Blocks


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: Name | None = None  # where the OpenAI routes take `user`: accepted, charged nothing extra


def _text(content: str | list[ContentBlock], param: str) -> str:
    """Text content blocks joined; tool blocks (not offered yet) and other kinds answer 400 naming the block."""
    if isinstance(content, str):
        return content
    for j, block in enumerate(content):
        if block.type in ("tool_use", "tool_result", "server_tool_use"):
            raise ApiError(400, f"{block.type} content blocks are not supported yet", param=f"{param}.{j}")
        if block.type != "text":
            raise ApiError(400, f"only text content blocks are supported; got '{block.type}'",
                           param=f"{param}.{j}.type")
    return "".join(b.text or "" for b in content)


class CountTokensRequest(BaseModel):
    """The body of `/v1/messages/count_tokens`: what a Messages request's prompt is made of."""

    model_config = ConfigDict(extra="allow")
    model: Name
    messages: Annotated[list[InputMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: Content | Blocks | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None

    # accepted and harmless: they change nothing about the text
    _IGNORED = frozenset({"service_tier", "container", "context_management", "cache_control", "inference_geo",
                          "speed", "diagnostics", "user_profile_id", "workspace_id"})

    def refuse_unsupported(self) -> None:
        self.refuse_tools()
        if self.thinking is not None and self.thinking.get("type") != "disabled":
            raise ApiError(400, "extended thinking is not supported", param="thinking")
        for name in self.model_extra or {}:
            if name not in self._IGNORED:
                raise ApiError(400, f"unsupported parameter: {name}", param=name)

    def refuse_tools(self) -> None:
        """Tools are not offered yet: `tools`, and a `tool_choice` other than none (or auto without tools)."""
        if self.tools:
            raise ApiError(400, "tools are not supported yet", param="tools")
        if self.tool_choice is not None and self.tool_choice.get("type") not in ("none", "auto"):
            raise ApiError(400, "tool_choice must be none or auto: tools are not supported yet", param="tool_choice")

    def chat(self) -> list[Message]:
        """The conversation as the job's messages: `system` first, each message's text blocks joined."""
        out = []
        if self.system:
            out.append(Message(role="system", content=_text(self.system, "system")))
        for i, m in enumerate(self.messages):
            out.append(Message(role=m.role, content=_text(m.content, f"messages.{i}.content")))
        return out


class MessagesRequest(CountTokensRequest):
    """The body of `POST /v1/messages`."""

    max_tokens: MaxTokens
    stop_sequences: StopList | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    metadata: Metadata | None = None
    stream: bool = False

    def to_generation(self) -> GenerationRequest:
        """The one generation request this asks for (not yet within the deployment's bounds: check_request)."""
        self.refuse_unsupported()
        sampling = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k") if getattr(self, k) is not None}
        try:
            return GenerationRequest(messages=self.chat(), max_tokens=self.max_tokens, stop=self.stop_sequences or [],
                                     **sampling)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(x) for x in err.get("loc", ()))
            raise ApiError(400, f"{where}: {err.get('msg', 'invalid')}", param=where or None) from None


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """Every 4xx and 5xx answer on the Messages routes (a body over the size cap aside: the common 413)."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": AnthropicError, "description": text}
    for status, text in ((400, "Invalid request"), (401, "Missing or invalid API key"),
                         (404, "Unknown model"), (429, "Over a limit; see Retry-After"), (500, "Internal error"),
                         (503, "Overloaded or unavailable; retry"))
}


def message_id(job: Job) -> str:
    return "msg_" + job.id.removeprefix("job_")


def stop_reason(job: Job, stop_sequence: str | None) -> str:
    if job.finish_reason is FinishReason.length:
        return "max_tokens"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def message_body(job: Job, stop_sequence: str | None) -> dict[str, Any]:
    """Anthropic's `message` object for an ended job."""
    return {"id": message_id(job), "type": "message", "role": "assistant", "model": job.model,
            "content": [{"type": "text", "text": job.text}], "stop_reason": stop_reason(job, stop_sequence),
            "stop_sequence": stop_sequence,
            "usage": {"input_tokens": job.usage.prompt_tokens, "output_tokens": job.usage.completion_tokens}}


def event(kind: str, **payload: Any) -> bytes:
    """One stream event as Anthropic sends it: `event: <type>` and its JSON `data` with the same `type`."""
    return sse.encode(orjson.dumps({"type": kind, **payload}), event=kind)


def error_event(status: int, message: str) -> bytes:
    return sse.encode(orjson.dumps(anthropic_body(status, message)), event="error")


class MessageStream:
    """One message's stream events, for a job: `start` once its prompt is counted, a `delta` per chunk of
    text, `end` once it ended (`stop_sequence` as found)."""

    def __init__(self, job: Job) -> None:
        self.job = job

    def start(self, input_tokens: int) -> list[bytes]:
        message: dict[str, Any] = {
            "id": message_id(self.job), "type": "message", "role": "assistant", "model": self.job.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0}}
        return [event("message_start", message=message),
                event("content_block_start", index=0, content_block={"type": "text", "text": ""}),
                event("ping")]

    @staticmethod
    def delta(text: str) -> bytes:
        return event("content_block_delta", index=0, delta={"type": "text_delta", "text": text})

    @staticmethod
    def end(job: Job, stop_sequence: str | None) -> list[bytes]:
        usage = {"input_tokens": job.usage.prompt_tokens, "output_tokens": job.usage.completion_tokens}
        return [event("content_block_stop", index=0),
                event("message_delta", delta={"stop_reason": stop_reason(job, stop_sequence),
                                              "stop_sequence": stop_sequence}, usage=usage),
                event("message_stop")]


StopOf = Callable[[Job], Awaitable[str | None]]
