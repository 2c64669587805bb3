"""The job model: statuses, finish reasons, the record kept in Redis and its state transitions.

A job record is a Redis hash (`names.job_key`). Transitions that race (a cancel against a
worker starting the job, two workers finishing it) are Lua scripts (shared/scripts/), so each is
atomic; shared/job_ops.py calls them.
"""

from __future__ import annotations

import time
from enum import Enum
from typing import Any

from pydantic import BaseModel, Field

from shared.logprobs import chat_item, parse_lines, parse_prompt
from shared.tool_parsers import openai_calls, parse


class JobStatus(str, Enum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"


ACTIVE = frozenset({JobStatus.queued, JobStatus.running})
TERMINAL = frozenset({JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled})
# a batch's end statuses (OpenAI's Batch API), each also the type of the webhook event announcing it
BATCH_ENDS = ("completed", "failed", "expired", "cancelled")


class FinishReason(str, Enum):
    stop = "stop"
    length = "length"
    cancelled = "cancelled"
    error = "error"


class DamagedRecord(ValueError):
    """A job record that lacks what every record has from its submission (`id`, `status`, `created_at`) or
    holds a value that cannot be read (a number, a status, a finish reason). A Redis failover can leave one:
    a later write landing in a hash the failover had emptied. Its job can never complete; the API answers it
    as a job that is gone (404), streams end as for an expired job."""

    def __init__(self, job_id: str, problem: str) -> None:
        super().__init__(f"job {job_id!r} has an incomplete record ({problem})")
        self.job_id, self.problem = job_id, problem


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class Job(BaseModel):
    """The job object clients see (poll, `done` event, submit and cancel responses)."""

    id: str
    object: str = "job"
    status: JobStatus
    model: str
    text: str = ""
    finish_reason: FinishReason | None = None
    usage: Usage
    error: str | None = None
    queue_position: int | None = None
    created_at: float
    started_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    owner: str = Field("", exclude=True)  # the tenant that submitted it ('' when auth is off); never shown
    # per generated token, when the request asked (`logprobs`/`top_logprobs`): {token, logprob, bytes, top_logprobs}
    logprobs: list[dict[str, Any]] | None = None
    # per prompt token, when asked (`prompt_logprobs`): the same, null for the first (nothing precedes it)
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    # the compact entries behind those, and the prompt's text (shared/logprobs.py), for the OpenAI routes
    entries: list[Any] | None = Field(None, exclude=True)
    prompt: tuple[str, list[Any]] | None = Field(None, exclude=True)
    # the tool calls its text holds (a job that offered tools: its record names the parser), in OpenAI's shape;
    # `text` stays as the model wrote it, and `content` is what a client is shown as its answer: the text outside the
    # calls (None when there is none; markup of a call cut short is neither), the text itself when no tools were offered
    tool_calls: list[dict[str, Any]] | None = None
    content: str | None = Field(None, exclude=True)
    # with a tool parser: the text's pieces outside the calls and the calls' indices, in the text's order
    parts: list[str | int] | None = Field(None, exclude=True)
    # the stop string that ended it (the output lane's match; None: it ended otherwise), for the routes that name it
    stop_sequence: str | None = Field(None, exclude=True)

    @classmethod
    def from_record(cls, rec: dict[str, str], job_id: str = "") -> Job:
        """The job a record holds; DamagedRecord (naming `job_id`, else the record's own id) when it cannot
        be read."""
        missing = [name for name in ("id", "status", "created_at") if not rec.get(name)]
        if missing:
            raise DamagedRecord(job_id or rec.get("id") or "", "missing " + ", ".join(missing))
        try:
            return cls._read(rec)
        except (ValueError, TypeError, KeyError) as exc:  # a number, status or finish reason that is not one,
            # logprobs cut short (pydantic's errors are ValueErrors too)
            problem = f"no {exc}" if isinstance(exc, KeyError) else str(exc).splitlines()[0]
            raise DamagedRecord(job_id or rec["id"], f"unreadable: {problem}") from None

    @classmethod
    def _read(cls, rec: dict[str, str]) -> Job:
        def num(name: str) -> float | None:
            v = rec.get(name)
            return float(v) if v else None

        prompt = int(rec.get("prompt_tokens") or 0)
        completion = int(rec.get("completion_tokens") or 0)
        entries = parse_lines(rec["logprobs"]) if rec.get("logprobs") else None
        prompt_doc = parse_prompt(rec["prompt_logprobs"]) if rec.get("prompt_logprobs") else None
        text = rec.get("text", "")
        calls: list[dict[str, Any]] | None = None
        content: str | None = text
        parts: list[str | int] | None = None
        if rec.get("tool_parser"):
            parsed = parse(rec["tool_parser"], text)
            calls, content, parts = (openai_calls(rec["id"], parsed.calls) or None), parsed.content, parsed.order
        return cls(
            tool_calls=calls,
            content=content,
            parts=parts,
            logprobs=None if entries is None else [chat_item(e) for e in entries],
            prompt_logprobs=None if prompt_doc is None else [
                None if e[2] is None else chat_item(e) for e in prompt_doc[1]],
            entries=entries,
            prompt=prompt_doc,
            id=rec["id"],
            status=JobStatus(rec["status"]),
            model=rec.get("model", ""),
            text=text,
            finish_reason=FinishReason(rec["finish_reason"]) if rec.get("finish_reason") else None,
            usage=Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion),
            error=rec.get("error") or None,
            created_at=float(rec["created_at"]),
            started_at=num("started_at"),
            first_token_at=num("first_token_at"),
            finished_at=num("finished_at"),
            owner=rec.get("owner") or "",
            stop_sequence=rec.get("stop_sequence") or None,
        )

    @property
    def ended(self) -> bool:
        return self.status in TERMINAL


# a job's stages, each from the first of its record's times to the second (unix s; the tokenizer pool's and the
# engine's are written with the job's end, by its last worker: a resumed job's are that attempt's)
STAGES = (("waiting", "created_at", "tokenize_at"), ("tokenizing", "tokenize_at", "tokenized_at"),
          ("queued for a worker", "tokenized_at", "started_at"), ("waiting for a slot", "started_at", "scheduled_at"),
          ("prefill", "scheduled_at", "first_token_at"), ("decode", "first_token_at", "finished_at"))
STAGE_FIELDS = tuple(dict.fromkeys(f for _, a, b in STAGES for f in (a, b)))


def stages(times: dict[str, str | None]) -> list[dict[str, Any]]:
    """The stages a record's times (STAGE_FIELDS) show, in order: {stage, start, end}; a stage whose times are
    not (yet) both known is left out."""
    out = []
    for stage, a, b in STAGES:
        start, end = times.get(a), times.get(b)
        if start and end:
            out.append({"stage": stage, "start": float(start), "end": max(float(start), float(end))})
    return out


def new_record(job_id: str, model: str, request_json: str, tool_parser: str = "") -> dict[str, Any]:
    """A queued job's record; `tool_parser` names the format its output's tool calls are read in ('' none)."""
    record: dict[str, Any] = {
        "id": job_id,
        "status": JobStatus.queued.value,
        "model": model,
        "request": request_json,
        "created_at": repr(time.time()),
        "seq": 0,
    }
    if tool_parser:
        record["tool_parser"] = tool_parser
    return record

