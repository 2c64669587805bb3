"""OpenAI's Responses API on the job path: a response is a job whose record also holds what the Responses API
needs (`response`: its input items, instructions, metadata, the conversation so far); it lives and expires with
the job (JOB_TTL_S) and belongs to the key that made it. This module holds the request body, its mapping onto
the generation request, the Response object a job shows as, and the streaming events with their sequence
numbers, which derive from the job's own event seqs so any API process can resume a stream at any point. The
Response object itself is shared/openai_bodies.py's (a batch line's body is one too)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

import orjson
from pydantic import BaseModel, ConfigDict, Field

from api.errors import ApiError
from shared.jobs import Job
from shared.limits import MAX_MESSAGES, Content, MaxTokens, Name, Temperature, TopP
from shared.openai_bodies import message, response_object, response_status
from shared.schemas import GenerationRequest, Message

HEAD = 4  # created, in_progress, output_item.added, content_part.added: sequence numbers 0-3; token k is 3 + k
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


class ResponseRequest(BaseModel):
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
    metadata: Annotated[dict[Name, Name], Field(max_length=16)] | None = None
    text: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    ignore_eos: bool = False  # vLLM's

    _IGNORED = {"reasoning", "include", "truncation", "service_tier", "user", "parallel_tool_calls",
                "prompt_cache_key", "safety_identifier", "top_logprobs", "max_tool_calls"}

    def check(self) -> None:
        for name in self.model_extra or {}:
            if name not in self._IGNORED:
                raise ApiError(400, f"unsupported parameter: {name}", param=name)
        if self.tools or self.tool_choice not in (None, "none", "auto"):
            raise ApiError(400, "tools are not supported", param="tools")
        if self.background and not self.store:
            raise ApiError(400, "a background response must be stored (store: true)", param="store")

    def input_messages(self) -> list[dict[str, str]]:
        """The input as chat messages ({role, content}); a string is one user message."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out = []
        for i, item in enumerate(self.input):
            role, content = item.get("role"), item.get("content")
            if item.get("type", "message") != "message" or role not in _ROLES:
                raise ApiError(400, "input items must be messages with role user, assistant, system or developer",
                               param=f"input.{i}")
            if isinstance(content, list):
                if not all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
                           and isinstance(p.get("text"), str) for p in content):
                    raise ApiError(400, "only text content parts are supported", param=f"input.{i}.content")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise ApiError(400, "a message's content must be text", param=f"input.{i}.content")
            out.append({"role": _ROLES[role], "content": content})
        return out

    def generation(self, conversation: list[dict[str, str]]) -> GenerationRequest:
        """The generation request for this conversation (instructions first, as a system message)."""
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) + conversation
        fields: dict[str, Any] = {"messages": [Message(**m) for m in messages], "ignore_eos": self.ignore_eos}
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
        except ValueError as exc:
            raise ApiError(400, f"invalid request: {exc}", param="text.format" if fmt else None) from None

    def meta(self, conversation: list[dict[str, str]]) -> str:
        """What the job's record keeps for the Responses API."""
        return orjson.dumps({
            "input": self.input if isinstance(self.input, list) else [
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": self.input}]}],
            "conversation": conversation, "instructions": self.instructions, "metadata": self.metadata or {},
            "previous_response_id": self.previous_response_id, "background": self.background, "store": self.store,
            "temperature": self.temperature, "top_p": self.top_p, "max_output_tokens": self.max_output_tokens,
            "text": self.text or {"format": {"type": "text"}}}).decode()


def job_id_of(resp_id: str) -> str | None:
    return "job_" + resp_id.removeprefix("resp_") if resp_id.startswith("resp_") else None


def head_events(job: Job, meta: dict[str, Any]) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """The opening events, sequence numbers 0-3."""
    item_id = "msg_" + job.id.removeprefix("job_")
    yield 0, "response.created", {"response": response_object(job, meta, "queued")}
    yield 1, "response.in_progress", {"response": response_object(job, meta, "in_progress")}
    yield 2, "response.output_item.added", {"output_index": 0, "item": message(job, "", False)}
    yield 3, "response.content_part.added", {"item_id": item_id, "output_index": 0, "content_index": 0,
                                             "part": {"type": "output_text", "text": "", "annotations": []}}


def delta_event(job: Job, seq: int, text: str) -> tuple[int, str, dict[str, Any]]:
    """The job's token event `seq` (1, 2, ...) as an output_text.delta."""
    return HEAD - 1 + seq, "response.output_text.delta", {
        "item_id": "msg_" + job.id.removeprefix("job_"), "output_index": 0, "content_index": 0, "delta": text,
        "logprobs": []}


def tail_events(end: Job, meta: dict[str, Any], done_seq: int) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """The closing events after the job's `done` event (its seq): text, part and item done, then the end."""
    item_id = "msg_" + end.id.removeprefix("job_")
    part = {"type": "output_text", "text": end.text, "annotations": [], "logprobs": []}
    n = HEAD - 1 + done_seq
    yield n, "response.output_text.done", {"item_id": item_id, "output_index": 0, "content_index": 0,
                                           "text": end.text, "logprobs": []}
    yield n + 1, "response.content_part.done", {"item_id": item_id, "output_index": 0, "content_index": 0,
                                                "part": part}
    yield n + 2, "response.output_item.done", {"output_index": 0, "item": message(end, end.text, True)}
    state = response_status(end)
    yield n + 3, f"response.{state}", {"response": response_object(end, meta)}
