"""Anthropic's Messages API on the job path: its request bodies (mapped onto one `GenerationRequest`), its
`message` object, and its stream's events (`message_start` ... `message_stop`, `error`), framed as Anthropic
sends them.

Tools are OpenAI's underneath: Anthropic's `tools` ({name, description, input_schema}) and `tool_choice`
(auto, any, tool, none) become function tools and a tool choice; an assistant's `tool_use` blocks become its
`tool_calls`, a user's `tool_result` blocks `tool` messages. The calls read out of the output
(TOOL_CALL_PARSER) come back as `tool_use` blocks, streamed as `input_json_delta`s."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from api import sse
from api.errors import ApiError, anthropic_body
from api.openai_schemas import ClientBody, request_error
from shared import tool_parsers
from shared.jobs import FinishReason, Job
from shared.limits import MAX_MESSAGES, Content, MaxTokens, Name, StopList, Temperature, TopK, TopP, shallow
from shared.schemas import GenerationRequest, Message
from shared.tool_parsers import CallStart, ContentDelta, StreamEvent, call_id

MAX_BLOCKS = 256  # content blocks in one message, or in `system`


class ContentBlock(BaseModel):
    model_config = ConfigDict(extra="allow")  # cache_control, citations: accepted, they change no text
    type: Name
    text: Content | None = None
    id: Name | None = None  # tool_use's
    name: Name | None = None  # tool_use's
    input: dict[str, Any] | None = None  # tool_use's
    tool_use_id: Name | None = None  # tool_result's: the tool_use it answers
    content: Content | Annotated[list[dict[str, Any]], Field(max_length=MAX_BLOCKS)] | None = None  # tool_result's
    is_error: bool = False  # tool_result's


Blocks = Annotated[list[ContentBlock], Field(max_length=MAX_BLOCKS)]


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: Content | Blocks


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: Name | None = None  # where the OpenAI routes take `user`: accepted, charged nothing extra


def _text(content: str | list[ContentBlock], param: str) -> str:
    """Text content blocks joined; other kinds answer 400 naming the block."""
    if isinstance(content, str):
        return content
    for j, block in enumerate(content):
        if block.type != "text":
            raise ApiError(400, f"only text content blocks are allowed here; got '{block.type}'",
                           param=f"{param}.{j}.type")
    return "".join(b.text or "" for b in content)


def _turns(i: int, m: InputMessage, used: set[str]) -> list[Message]:
    """One Anthropic message as the job's messages: an assistant's text and `tool_use` blocks (its calls, their ids
    added to `used`); a user's `tool_result` blocks (each a `tool` message, in order; 400 naming the block when it
    answers no earlier tool_use) and its text."""
    if isinstance(m.content, str):
        return [Message(role=m.role, content=m.content)]
    text, calls, results = [], [], []
    for j, b in enumerate(m.content):
        where = f"messages.{i}.content.{j}"
        if b.type == "text":
            text.append(b.text or "")
        elif b.type == "tool_use" and m.role == "assistant":
            if not b.id or not b.name:
                raise ApiError(400, f"{where}: a tool_use block needs an id and a name", param=where)
            calls.append({"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": orjson.dumps(b.input or {}).decode()}})
            used.add(b.id)
        elif b.type == "tool_result" and m.role == "user":
            if not b.tool_use_id:
                raise ApiError(400, f"{where}: a tool_result block needs its tool_use_id", param=where)
            if b.tool_use_id not in used:
                raise ApiError(400, f"{where}.tool_use_id: {b.tool_use_id!r} answers no earlier tool_use block",
                               param=f"{where}.tool_use_id")
            body = b.content if isinstance(b.content, str) else _result_text(b.content or [], where)
            results.append(Message(role="tool", content=("Error: " if b.is_error else "") + body,
                                   tool_call_id=b.tool_use_id))
        else:
            raise ApiError(400, f"{where}.type: a {m.role} message cannot hold a '{b.type}' block",
                           param=f"{where}.type")
    joined = "".join(text)
    if m.role == "assistant":
        return [Message(role="assistant", content=joined, tool_calls=calls or None)]
    return results + ([Message(role="user", content=joined)] if joined or not results else [])


def _result_text(blocks: list[dict[str, Any]], where: str) -> str:
    if not all(isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str) for b in blocks):
        raise ApiError(400, "a tool_result's content must be text", param=f"{where}.content")
    return "".join(b["text"] for b in blocks)


def _function_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """Anthropic's client tools as OpenAI's function tools; 400 naming one that is not a client tool."""
    out = []
    for k, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "custom") != "custom" or "input_schema" not in t:
            raise ApiError(400, "only client tools ({name, description, input_schema}) are supported",
                           param=f"tools.{k}")
        schema = t["input_schema"]
        if not isinstance(schema, dict) or schema.get("type") != "object":  # a tool's input is an object
            raise ApiError(400, "input_schema.type must be 'object'", param=f"tools.{k}.input_schema.type")
        fn = {"name": t.get("name"), "parameters": t["input_schema"]}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool]:
    """Anthropic's tool_choice as OpenAI's, and whether calls may come in parallel."""
    if choice is None:
        return None, True
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(str(kind))
    if mapped is None:
        raise ApiError(400, "tool_choice.type must be auto, any, tool or none", param="tool_choice")
    return mapped, parallel


def continues(messages: list[Message]) -> bool:
    """Whether the conversation's last message is the assistant's text, which the output continues (a prefill)
    rather than answers."""
    return messages[-1].role == "assistant" and not messages[-1].tool_calls


class CountTokensRequest(ClientBody):
    """The body of `/v1/messages/count_tokens`: what a Messages request's prompt is made of."""

    model_config = ConfigDict(extra="allow")
    model: Name
    messages: Annotated[list[InputMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: Content | Blocks | None = None
    tools: Annotated[list[Any], AfterValidator(shallow)] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None

    # accepted and harmless: they change nothing about the text
    _IGNORED = frozenset({"service_tier", "container", "context_management", "cache_control", "inference_geo",
                          "speed", "diagnostics", "user_profile_id", "workspace_id"})

    def refuse_unsupported(self) -> None:
        if self.thinking is not None and self.thinking.get("type") != "disabled":
            raise ApiError(400, "extended thinking is not supported", param="thinking")
        for name in self.model_extra or {}:
            if name not in self._IGNORED:
                raise ApiError(400, f"unsupported parameter: {name}", param=name)

    def chat(self) -> list[Message]:
        """The conversation as the job's messages: `system` first, then each message's turns."""
        out = []
        if self.system:
            out.append(Message(role="system", content=_text(self.system, "system")))
        used: set[str] = set()
        for i, m in enumerate(self.messages):
            out.extend(_turns(i, m, used))
        return out

    def tool_fields(self) -> dict[str, Any]:
        """`tools`, `tool_choice` and `parallel_tool_calls` as a GenerationRequest takes them."""
        choice, parallel = _tool_choice(self.tool_choice)
        return {"tools": _function_tools(self.tools) if self.tools else None, "tool_choice": choice,
                "parallel_tool_calls": parallel}

    def prompt_tools(self) -> list[dict[str, Any]] | None:
        """The tools its prompt shows (none with tool_choice none), for count_tokens."""
        fields = self.tool_fields()
        return None if fields["tool_choice"] == "none" else fields["tools"]


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
            messages = self.chat()
            prefill = continues(messages)
            return GenerationRequest(messages=messages, max_tokens=self.max_tokens, stop=self.stop_sequences or [],
                                     continue_final_message=prefill, **sampling, **self.tool_fields())
        except ValidationError as exc:
            err = request_error(exc)
            raise ApiError(400, err.message, param=err.param) from None


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


def stop_reason(job: Job, called: bool = False) -> str:
    """A succeeded job's: a stop sequence outranks a tool call (the call it cut short is no call to run)."""
    if job.finish_reason is FinishReason.length:
        return "max_tokens"
    if job.stop_sequence is not None:
        return "stop_sequence"
    return "tool_use" if called else "end_turn"


def tool_use_id(job: Job, index: int) -> str:
    return call_id(job.id, index, "toolu_")


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as its tool_use block's `input` (a call cut short, whose text does not parse: {})."""
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def message_body(job: Job) -> dict[str, Any]:
    """Anthropic's `message` object for an ended job: its text and tool_use blocks in the order its text has them
    (as its stream opens them); one empty text block when it said nothing."""
    calls = job.tool_calls or []
    content: list[dict[str, Any]] = []
    for part in job.parts if job.parts is not None else [job.content or ""]:
        if isinstance(part, int):
            c = calls[part]
            content.append({"type": "tool_use", "id": tool_use_id(job, part), "name": c["function"]["name"],
                            "input": tool_input(c["function"]["arguments"])})
        elif part:
            content.append({"type": "text", "text": part})
    content = content or [{"type": "text", "text": ""}]
    return {"id": message_id(job), "type": "message", "role": "assistant", "model": job.model,
            "content": content, "stop_reason": stop_reason(job, bool(calls)), "stop_sequence": job.stop_sequence,
            "usage": {"input_tokens": job.usage.prompt_tokens, "output_tokens": job.usage.completion_tokens}}


def event(kind: str, **payload: Any) -> bytes:
    """One stream event as Anthropic sends it: `event: <type>` and its JSON `data` with the same `type`."""
    return sse.encode(orjson.dumps({"type": kind, **payload}), event=kind)


def error_event(status: int, message: str) -> bytes:
    return sse.encode(orjson.dumps(anthropic_body(status, message)), event="error")


class MessageStream:
    """One message's stream events, for a job: `start` once its prompt is counted, `text` per chunk of text,
    `end` once it ended. Without tools, one text block, opened at the start; with a
    tool parser (TOOL_CALL_PARSER), blocks open as the text shows them: text, then a tool_use block per call
    (its `input` as input_json_delta fragments)."""

    def __init__(self, job: Job, tool_parser: str | None = None) -> None:
        self.job = job
        self.parser = tool_parsers.stream(tool_parser) if tool_parser else None
        self.index = -1  # the open block's index (-1: none yet)
        self.open: str | None = None  # its kind: "text" or "tool_use"
        self.called = False

    def start(self, input_tokens: int) -> list[bytes]:
        message: dict[str, Any] = {
            "id": message_id(self.job), "type": "message", "role": "assistant", "model": self.job.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0}}
        out = [event("message_start", message=message)]
        if self.parser is None:
            out += self._open("text", {"type": "text", "text": ""})
        return [*out, event("ping")]

    def text(self, text: str) -> list[bytes]:
        if self.parser is None:
            return [self._text_delta(text)] if text else []
        out: list[bytes] = []
        for ev in self.parser.feed(text):
            out += self._event(ev)
        return out

    def end(self, job: Job) -> list[bytes]:
        out: list[bytes] = []
        if self.parser is not None:
            for ev in self.parser.finish():
                out += self._event(ev)
        if self.open is None:  # nothing was said: an empty text block, as Anthropic's
            out += self._open("text", {"type": "text", "text": ""})
        usage = {"input_tokens": job.usage.prompt_tokens, "output_tokens": job.usage.completion_tokens}
        return [*out, *self._close(),
                event("message_delta", delta={"stop_reason": stop_reason(job, self.called),
                                              "stop_sequence": job.stop_sequence}, usage=usage),
                event("message_stop")]

    def _event(self, ev: StreamEvent) -> list[bytes]:
        if isinstance(ev, ContentDelta):
            opened = [] if self.open == "text" else self._open("text", {"type": "text", "text": ""})
            return [*opened, self._text_delta(ev.text)]
        if isinstance(ev, CallStart):
            self.called = True
            return self._open("tool_use", {"type": "tool_use", "id": tool_use_id(self.job, ev.index),
                                           "name": ev.name, "input": {}})
        return [event("content_block_delta", index=self.index,
                      delta={"type": "input_json_delta", "partial_json": ev.fragment})]

    def _text_delta(self, text: str) -> bytes:
        return event("content_block_delta", index=self.index, delta={"type": "text_delta", "text": text})

    def _open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.index, self.open = self.index + 1, kind
        return [*out, event("content_block_start", index=self.index, content_block=block)]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", index=self.index)]

