"""OpenAI's Responses API on the job path: a response is a job whose record also holds what the Responses API
needs (`response`: its input items, instructions, metadata, the conversation so far); it lives and expires with
the job (JOB_TTL_S) and belongs to the key that made it. This module holds the request body, its mapping onto
the generation request, the Response object a job shows as, and the streaming events with their sequence
numbers, which derive from the job's own event seqs so any API process can resume a stream at any point. The
Response object itself is shared/openai_bodies.py's (a batch line's body is one too)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, ClassVar, Literal

import orjson
from pydantic import AfterValidator, ConfigDict, Field, ValidationError

from api.errors import ApiError
from api.openai_schemas import ClientBody, request_error
from shared import tool_parsers
from shared.grammar.tools import MAX_TOOLS
from shared.jobs import Job
from shared.limits import MAX_MESSAGES, Content, Logprobs, MaxTokens, Metadata, Name, Temperature, TopP, shallow
from shared.logprobs import Entry, chat_item
from shared.openai_bodies import call_status, function_call, message, response_object, response_status
from shared.schemas import GenerationRequest, Message

HEAD = 4  # created, in_progress, output_item.added, content_part.added: sequence numbers 0-3; token k is 3 + k
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


class ResponseRequest(ClientBody):
    model_config = ConfigDict(extra="allow")
    model: Name | None = None
    input: Content | Annotated[list[dict[str, Any]], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: Content | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: Name | None = None
    metadata: Metadata | None = None
    text: dict[str, Any] | None = None
    tools: Annotated[list[Any], Field(max_length=MAX_TOOLS), AfterValidator(shallow)] | None = None  # function tools
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    ignore_eos: bool = False  # vLLM's
    include: Annotated[list[Name], Field(max_length=16)] | None = None
    top_logprobs: Logprobs | None = None
    truncation: Literal["auto", "disabled"] | None = None  # auto: the oldest turns go until the context holds it

    _IGNORED = {"reasoning", "service_tier", "user", "prompt_cache_key", "safety_identifier",
                "max_tool_calls"}
    LOGPROBS: ClassVar[str] = "message.output_text.logprobs"  # what `include` names to have each output_text's logprobs

    @property
    def logprobs(self) -> bool:
        return self.LOGPROBS in (self.include or [])

    def check(self) -> None:
        for name in self.model_extra or {}:
            if name not in self._IGNORED:
                raise ApiError(400, f"unsupported parameter: {name}", param=name)
        if self.background and not self.store:
            raise ApiError(400, "a background response must be stored (store: true)", param="store")

    def input_messages(self) -> list[dict[str, Any]]:
        """The input as chat messages ({role, content}, an assistant's `tool_calls`, a tool's `tool_call_id`): a
        string is one user message; `function_call` items are the calls of the assistant turn they follow,
        `function_call_output` items tool messages."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict[str, Any]] = []
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind == "function_call":
                out = _with_call(out, item, i)
            elif kind == "function_call_output":
                output = _text_of(item.get("output"), f"input.{i}.output")
                out.append({"role": "tool", "tool_call_id": _string(item, "call_id", i), "content": output})
            elif kind == "message" and item.get("role") in _ROLES:
                text = _text_of(item.get("content"), f"input.{i}.content")
                out.append({"role": _ROLES[item["role"]], "content": text})
            else:
                raise ApiError(400, "input items must be messages (role user, assistant, system or developer), "
                                    "function_call or function_call_output items", param=f"input.{i}")
        return out

    def generation(self, conversation: list[dict[str, Any]]) -> GenerationRequest:
        """The generation request for this conversation (instructions first, as a system message)."""
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) + conversation
        try:
            turns = [Message(**m) for m in messages]
        except ValidationError as exc:
            raise ApiError(400, f"input: {exc.errors()[0].get('msg', 'invalid')}", param="input") from None
        fields: dict[str, Any] = {"messages": turns, "ignore_eos": self.ignore_eos, "tool_choice": self.tool_choice,
                                  "logprobs": self.logprobs, "top_logprobs": self.top_logprobs or 0,
                                  "parallel_tool_calls": self.parallel_tool_calls,
                                  "truncation": self.truncation or "disabled",
                                  "tools": [_function_tool(t, k) for k, t in enumerate(self.tools or [])] or None}
        for ours, theirs in (("max_tokens", self.max_output_tokens), ("temperature", self.temperature),
                             ("top_p", self.top_p)):
            if theirs is not None:
                fields[ours] = theirs
        fmt = (self.text or {}).get("format")
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            fields["response_format"] = {"type": "json_schema", "json_schema": {"schema": fmt.get("schema", {})}}
        elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
            fields["response_format"] = {"type": "json_object"}
        elif fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            raise ApiError(400, "text.format must be text, json_object or json_schema", param="text.format")
        try:
            return GenerationRequest(**fields)
        except ValidationError as exc:
            err = request_error(exc)
            param = err.param or ("text.format" if fmt else None)
            raise ApiError(400, f"invalid request: {err.message}", param=param) from None

    def meta(self, conversation: list[dict[str, Any]], tool_parser: str | None = None) -> str:
        """What the job's record keeps for the Responses API."""
        return orjson.dumps({
            "input": self.input if isinstance(self.input, list) else [
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": self.input}]}],
            "conversation": conversation, "instructions": self.instructions, "metadata": self.metadata or {},
            "previous_response_id": self.previous_response_id, "background": self.background, "store": self.store,
            "temperature": self.temperature, "top_p": self.top_p, "max_output_tokens": self.max_output_tokens,
            "text": self.text or {"format": {"type": "text"}}, "tools": self.tools or [],
            "tool_choice": self.tool_choice or ("auto" if self.tools else "none"),
            "parallel_tool_calls": self.parallel_tool_calls, "tool_parser": tool_parser}).decode()


def _with_call(out: list[dict[str, Any]], item: dict[str, Any], i: int) -> list[dict[str, Any]]:
    """The conversation with a `function_call` item added to the assistant turn it follows (a new one if none)."""
    args = item.get("arguments")
    if not isinstance(args, str):
        raise ApiError(400, "a function_call's arguments must be a string (JSON text)", param=f"input.{i}.arguments")
    call = {"id": _string(item, "call_id", i), "type": "function",
            "function": {"name": _string(item, "name", i), "arguments": args}}
    if out and out[-1]["role"] == "assistant":
        last = out[-1]
        return [*out[:-1], {**last, "tool_calls": [*(last.get("tool_calls") or []), call]}]
    return [*out, {"role": "assistant", "content": "", "tool_calls": [call]}]


def _string(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"input.{i}.{key} must be a non-empty string", param=f"input.{i}.{key}")
    return value


def _text_of(content: Any, param: str) -> str:
    """A message's (or a call output's) text: a string, or text parts joined by newlines (as vLLM joins them)."""
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
                   and isinstance(p.get("text"), str) for p in content):
            raise ApiError(400, "only text content parts are supported", param=param)
        content = "\n".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, "content must be text", param=param)
    return content


def _function_tool(tool: Any, k: int) -> dict[str, Any]:
    """A Responses function tool ({type, name, description, parameters}) as Chat Completions nests it."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ApiError(400, "only function tools are supported", param=f"tools.{k}")
    return {"type": "function", "function": {key: tool[key] for key in ("name", "description", "parameters")
                                             if key in tool}}


def job_id_of(resp_id: str) -> str | None:
    return "job_" + resp_id.removeprefix("resp_") if resp_id.startswith("resp_") else None


def created_status(meta: dict[str, Any]) -> str:
    """The status `response.created` shows, as OpenAI's: `queued` for a background response, else `in_progress`."""
    return "queued" if meta.get("background") else "in_progress"


def head_events(job: Job, meta: dict[str, Any]) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """The opening events, sequence numbers 0-3."""
    item_id = "msg_" + job.id.removeprefix("job_")
    yield 0, "response.created", {"response": response_object(job, meta, created_status(meta))}
    yield 1, "response.in_progress", {"response": response_object(job, meta, "in_progress")}
    yield 2, "response.output_item.added", {"output_index": 0, "item": message(job, "", False)}
    yield 3, "response.content_part.added", {"item_id": item_id, "output_index": 0, "content_index": 0,
                                             "part": {"type": "output_text", "text": "", "annotations": []}}


def delta_event(job: Job, seq: int, text: str, logprobs: list[Entry] | None = None) -> tuple[int, str, dict[str, Any]]:
    """The job's token event `seq` (1, 2, ...) as an output_text.delta (with its tokens' logprobs, when asked)."""
    return HEAD - 1 + seq, "response.output_text.delta", {
        "item_id": "msg_" + job.id.removeprefix("job_"), "output_index": 0, "content_index": 0, "delta": text,
        "logprobs": [chat_item(e) for e in logprobs or []]}


def tail_events(end: Job, meta: dict[str, Any], done_seq: int) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """The closing events after the job's `done` event (its seq): text, part and item done, then the end."""
    item_id = "msg_" + end.id.removeprefix("job_")
    part = {"type": "output_text", "text": end.text, "annotations": [], "logprobs": end.logprobs or []}
    n = HEAD - 1 + done_seq
    yield n, "response.output_text.done", {"item_id": item_id, "output_index": 0, "content_index": 0,
                                           "text": end.text, "logprobs": end.logprobs or []}
    yield n + 1, "response.content_part.done", {"item_id": item_id, "output_index": 0, "content_index": 0,
                                                "part": part}
    yield n + 2, "response.output_item.done", {"output_index": 0, "item": message(end, end.text, True)}
    state = response_status(end)
    yield n + 3, f"response.{state}", {"response": response_object(end, meta)}


class ToolEvents:
    """A response's events when its output may hold tool calls (its meta names a `tool_parser`): the parser's
    events become output items as the text shows them (a message's text deltas; a function_call's
    `function_call_arguments.delta`s), each item added and done in turn. Sequence numbers count the events
    from 0 (created, in_progress, then one each), the same on every replay of the job's events from the start:
    a resumed stream replays them and skips those a client has."""

    def __init__(self, job: Job, meta: dict[str, Any]) -> None:
        self.job, self.meta = job, meta
        self.parser = tool_parsers.stream(meta["tool_parser"])
        self.seq = -1
        self.index = -1  # the open item's output_index
        self.item: dict[str, Any] | None = None  # the open item, its text or arguments so far in `said`
        self.said = ""

    def head(self) -> list[tuple[int, str, dict[str, Any]]]:
        return [self._next("response.created", {"response": response_object(self.job, self.meta,
                                                                              created_status(self.meta))}),
                self._next("response.in_progress", {"response": response_object(self.job, self.meta, "in_progress")})]

    def text(self, text: str) -> list[tuple[int, str, dict[str, Any]]]:
        return [e for ev in self.parser.feed(text) for e in self._event(ev)]

    def end(self, end: Job) -> list[tuple[int, str, dict[str, Any]]]:
        out = [e for ev in self.parser.finish() for e in self._event(ev)]
        out += self._close(end)
        return [*out, self._next(f"response.{response_status(end)}", {"response": response_object(end, self.meta)})]

    def _next(self, kind: str, data: dict[str, Any]) -> tuple[int, str, dict[str, Any]]:
        self.seq += 1
        return self.seq, kind, data

    def _event(self, ev: tool_parsers.StreamEvent) -> list[tuple[int, str, dict[str, Any]]]:
        out = []
        if isinstance(ev, tool_parsers.ContentDelta):
            if self.item is None or self.item["type"] != "message":
                out += self._open(message(self.job, "", False, self._message_id()))
                out.append(self._next("response.content_part.added", {
                    **self._at(), "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}}))
            self.said += ev.text
            out.append(self._next("response.output_text.delta", {**self._at(), "content_index": 0,
                                                                 "delta": ev.text, "logprobs": []}))
        elif isinstance(ev, tool_parsers.CallStart):
            out += self._open(function_call(self.job, ev.index, ev.name, "", False))
        else:
            self.said += ev.fragment
            out.append(self._next("response.function_call_arguments.delta", {**self._at(), "delta": ev.fragment}))
        return out

    def _message_id(self) -> str:
        base = "msg_" + self.job.id.removeprefix("job_")
        return base if self.index < 0 else f"{base}_{self.index + 1}"

    def _at(self) -> dict[str, Any]:
        assert self.item is not None
        return {"item_id": self.item["id"], "output_index": self.index}

    def _open(self, item: dict[str, Any]) -> list[tuple[int, str, dict[str, Any]]]:
        out = self._close()
        self.index, self.item, self.said = self.index + 1, item, ""
        return [*out, self._next("response.output_item.added", {"output_index": self.index, "item": item})]

    def _close(self, ended: Job | None = None) -> list[tuple[int, str, dict[str, Any]]]:
        """The open item's closing events; `ended`: the job, when this item is its output's last."""
        item, said = self.item, self.said
        if item is None:
            return []
        at, out = self._at(), []
        if item["type"] == "message":
            part = {"type": "output_text", "text": said, "annotations": [], "logprobs": []}
            out.append(self._next("response.output_text.done", {**at, "content_index": 0, "text": said,
                                                                "logprobs": []}))
            out.append(self._next("response.content_part.done", {**at, "content_index": 0, "part": part}))
            done = message(self.job, said, True, item["id"])
        else:
            out.append(self._next("response.function_call_arguments.done", {**at, "name": item["name"],
                                                                             "arguments": said}))
            done = {**item, "arguments": said, "status": call_status(ended, said, True) if ended else "completed"}
        self.item = None
        return [*out, self._next("response.output_item.done", {"output_index": at["output_index"], "item": done})]
