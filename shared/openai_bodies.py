"""An ended job as the bodies of OpenAI's APIs: a chat.completion or text_completion (its choices, usage,
streamed deltas), a Responses API Response object, and a Batch API result line (the output file's, with the
body its endpoint would have answered, and the error file's). Pure formatting of `Job`s, for every place
that answers one: the API's routes (api/routes/openai.py, api/responses.py), the batch API (api/batches.py)
and the batch driver (workers/batch_driver.py)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from shared.jobs import FinishReason, Job, JobStatus
from shared.logprobs import chat_item, completion_logprobs
from shared.tool_parsers import CallStart, ContentDelta, StreamEvent, call_id


def finish_reason(job: Job, called: bool | None = None) -> str | None:
    """OpenAI's finish reason: `tool_calls` for a job that stopped after making calls (`called`: whether it
    made any, when a stream knows better than the record); a job cancelled (by another caller: the completion's id
    is its job's) is vLLM's `abort`, a value OpenAI clients meet from vLLM servers, not the native `cancelled`."""
    made_calls = bool(job.tool_calls) if called is None else called
    if made_calls and job.finish_reason is FinishReason.stop:
        return "tool_calls"
    if job.finish_reason is FinishReason.cancelled:
        return "abort"
    return job.finish_reason.value if job.finish_reason else None


def tool_call_delta(job_id: str, ev: StreamEvent) -> dict[str, Any]:
    """A chat stream's `delta` for one parser event: content, a call's index, id and name, or its arguments."""
    if isinstance(ev, ContentDelta):
        return {"content": ev.text}
    if isinstance(ev, CallStart):
        return {"tool_calls": [{"index": ev.index, "id": call_id(job_id, ev.index), "type": "function",
                                "function": {"name": ev.name, "arguments": ""}}]}
    return {"tool_calls": [{"index": ev.index, "function": {"arguments": ev.fragment}}]}


@dataclass
class Shape:
    """How one endpoint writes its choices: chat (`message`/`delta`, logprobs as `content` items) or
    completions (`text`, legacy logprobs; with `echo` the prompt first)."""

    chat: bool
    logprobs: bool  # the client asked for them
    echo: bool
    prompts: list[str | None]  # each job's prompt text when the client gave text (echo), else None

    def choice(self, i: int, end: Job) -> dict[str, Any]:
        if self.chat:
            lp = {"content": [chat_item(e) for e in end.entries or []]} if self.logprobs else None
            said: dict[str, Any] = {"role": "assistant", "content": end.content or ""}
            if end.tool_calls:
                said = {"role": "assistant", "content": end.content, "tool_calls": end.tool_calls}
            return {"index": i, "message": said, "logprobs": lp, "finish_reason": finish_reason(end)}
        head, entries = self.head(i, end), end.entries or []
        if self.echo and self.logprobs and end.prompt is not None:
            lp = completion_logprobs(end.prompt[1] + entries)
        else:
            lp = completion_logprobs(entries, len(head)) if self.logprobs else None
        return {"index": i, "text": head + end.text, "logprobs": lp, "finish_reason": finish_reason(end)}

    def head(self, i: int, end: Job) -> str:
        """The echoed prompt: as the client sent it, or decoded from its token ids."""
        if not self.echo:
            return ""
        given = self.prompts[i]
        if given is not None:
            return given
        return end.prompt[0] if end.prompt is not None else ""

    def delta(self, i: int, text: str, entries: list[Any] | None, offset: int) -> dict[str, Any]:
        if self.chat:
            lp = {"content": [chat_item(e) for e in entries or []]} if self.logprobs else None
            return {"index": i, "delta": {"content": text}, "logprobs": lp, "finish_reason": None}
        lp = completion_logprobs(entries or [], offset) if self.logprobs else None
        return {"index": i, "text": text, "logprobs": lp, "finish_reason": None}


def usage_of(ends: list[Job], n: int) -> dict[str, int]:
    """Each prompt's tokens once (its n choices share it), every choice's completion tokens."""
    prompt = sum(e.usage.prompt_tokens for e in ends[::n])
    completion = sum(e.usage.completion_tokens for e in ends)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_id(chat: bool, job_id: str) -> str:
    """A completion's id, from its first job's."""
    return ("chatcmpl-" if chat else "cmpl-") + job_id.removeprefix("job_")


def completion_object(cid: str, created: int, ends: list[Job], shape: Shape, n: int) -> dict[str, Any]:
    """A whole chat.completion (`shape.chat`) or text_completion: every job's choice, in order, and the usage
    of `n` choices per prompt."""
    out: dict[str, Any] = {"id": cid, "object": "chat.completion" if shape.chat else "text_completion",
                           "created": created, "model": ends[0].model,
                           "choices": [shape.choice(i, e) for i, e in enumerate(ends)], "usage": usage_of(ends, n)}
    if shape.chat:
        out["system_fingerprint"] = None
    return out


def response_id(job_id: str) -> str:
    return "resp_" + job_id.removeprefix("job_")


def response_status(job: Job) -> str:
    if job.status is JobStatus.succeeded:
        return "incomplete" if job.finish_reason is FinishReason.length else "completed"
    shown: dict[JobStatus, str] = {JobStatus.queued: "queued", JobStatus.running: "in_progress"}
    return shown.get(job.status, str(job.status.value))


def message(job: Job, text: str, done: bool, item_id: str = "") -> dict[str, Any]:
    """A Responses `message` output item; one whose job ended short of its stop (max_output_tokens, a cancel, an
    error) is `incomplete`, as OpenAI marks it."""
    whole = job.finish_reason in (None, FinishReason.stop)
    return {"type": "message", "id": item_id or "msg_" + job.id.removeprefix("job_"), "role": "assistant",
            "status": ("completed" if whole else "incomplete") if done else "in_progress",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": (job.logprobs or []) if text == job.text else []}] if done else []}


def function_call(job: Job, index: int, name: str, arguments: str, done: bool, last: bool = False) -> dict[str, Any]:
    """A Responses `function_call` output item: the job's call `index` (`last`: its output's last item)."""
    status = call_status(job, arguments, last) if done else "in_progress"
    return {"type": "function_call", "id": call_id(job.id, index, "fc_"), "call_id": call_id(job.id, index),
            "name": name, "arguments": arguments, "status": status}


def call_status(job: Job, arguments: str, last: bool) -> str:
    """A finished function_call's status: `incomplete` when its job ended short of its stop (max_output_tokens, a
    cancel) inside it, its arguments cut off before they made an object (an agent must not run it); else
    `completed`."""
    if not last or job.finish_reason in (None, FinishReason.stop):
        return "completed"
    try:
        whole = isinstance(json.loads(arguments), dict)
    except ValueError:
        whole = False
    return "completed" if whole else "incomplete"


def output_items(job: Job) -> list[dict[str, Any]]:
    """An ended job's output items in the order its text has them, as its stream adds them (api/responses.py
    `ToolEvents`): a message per piece of text (the first `msg_<job>`, a later one `msg_<job>_<its index>`) and a
    function_call per call."""
    calls = job.tool_calls or []
    base, items = "msg_" + job.id.removeprefix("job_"), []
    parts = job.parts if job.parts is not None else [job.content or ""]
    for k, part in enumerate(parts):
        if isinstance(part, int):
            c = calls[part]
            items.append(function_call(job, part, c["function"]["name"], c["function"]["arguments"], True,
                                       last=k == len(parts) - 1))
        elif part:
            items.append(message(job, part, True, f"{base}_{len(items)}" if items else base))
    return items


def response_object(job: Job, meta: dict[str, Any], state: str | None = None) -> dict[str, Any]:
    """The Response a job shows as (`state` overrides its status, for a stream's opening events); `meta` is
    what the job's record keeps for the Responses API (api/responses.py `ResponseRequest.meta`)."""
    state = state or response_status(job)
    ended = state in ("completed", "incomplete", "failed", "cancelled")
    out: dict[str, Any] = {
        "id": response_id(job.id), "object": "response", "created_at": int(job.created_at), "status": state,
        "model": job.model, "output": output_items(job) if ended else [],
        "parallel_tool_calls": meta.get("parallel_tool_calls", True), "tool_choice": meta.get("tool_choice", "none"),
        "tools": meta.get("tools", []), "error": None, "incomplete_details": None,
        "usage": None, **{k: meta.get(k) for k in ("instructions", "previous_response_id", "background", "store",
                                                   "temperature", "top_p", "max_output_tokens", "text")},
        "metadata": meta.get("metadata") or {}}
    if ended:
        u = job.usage
        out["usage"] = {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                        "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                        "total_tokens": u.total_tokens}
    if state == "failed":  # refused before it started (a prompt over the context): the request's fault
        code = "invalid_prompt" if job.started_at is None else "server_error"
        out["error"] = {"code": code, "message": job.error or "generation failed"}
    if state == "incomplete":
        out["incomplete_details"] = {"reason": "max_output_tokens"}
    return out


def line_body(line: dict[str, Any], end: Job) -> dict[str, Any]:
    """The body a batch line's endpoint would have answered for its job (`line` as the batch stores it:
    its `endpoint`, whether it asked for `logprobs`, a Responses line's `response` meta)."""
    if line.get("endpoint") == "/v1/responses":
        return response_object(end, orjson.loads(line["response"]))
    chat = line.get("endpoint") == "/v1/chat/completions"
    shape = Shape(chat, bool(line.get("logprobs")), False, [None])
    return completion_object(completion_id(chat, end.id), int(end.created_at), [end], shape, 1)


def line_result(custom_id: str | None, end: Job, body: dict[str, Any]) -> dict[str, Any]:
    """A line of a batch's output file: its job succeeded with `body`."""
    return {"id": f"batch_req_{end.id.removeprefix('job_')}", "custom_id": custom_id, "error": None,
            "response": {"status_code": 200, "request_id": end.id, "body": body}}


def line_error(custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    """A line of a batch's error file."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}
