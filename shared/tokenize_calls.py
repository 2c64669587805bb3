"""Tokenize calls: a request the API makes of the tokenizer pool and waits for (`/tokenize`, `/detokenize`, the
Messages API's `count_tokens`), since the API never loads a tokenizer.

The mechanism, one round trip through Redis:
- The API picks a partition (one at random) and a call id in it (`names.tokenize_call_id`), subscribes to the call's
  channel through its relay (the channel is `names.job_channel(call_id)`: one pub/sub connection per node, as
  for jobs), then XADDs the call to the partition's `tokenize` stream (approximately capped at STREAM_MAXLEN).
- Tokenizer workers read every `tokenize` stream in the same XREADGROUP call as their `jobs` streams (same
  group). A worker answers each call with one reply: SET on `names.tokenize_reply_key(call_id)` with REPLY_TTL_S,
  and PUBLISH (SPUBLISH on a cluster) on the call's channel; then it acknowledges and deletes the entry. A call
  whose deadline has passed is dropped unanswered: its caller has given up.
- The API takes the reply from its subscription, or, when a message may have been missed (nothing heard for
  POLL_S), from the reply key; no reply within CALL_TIMEOUT_S is a 503.

Calls are small and bounded (their text as a job's prompt, MAX_PROMPT_CHARS; MAX_CALL_TOKENS ids), never a job:
nothing of them touches a job's keys, the fair queue or admission. A bad call (wrong types, ids outside the
vocabulary) is answered with an error naming the field, never raised in the worker.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

import orjson
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from shared.grammar.tools import MAX_TOOLS
from shared.limits import MAX_PROMPT_TOKEN_IDS, Content, TokenId, shallow
from shared.schemas import Message, prompt_chars

CALL_TIMEOUT_S = 5.0  # no reply this long after the call: 503
POLL_S = 0.5  # silence this long: read the reply key (a message missed during a relay reconnect)
REPLY_TTL_S = 30  # a reply key outlives its caller's wait
STREAM_MAXLEN = 10_000  # per partition, approximate: bounded while no tokenizer runs
MAX_CALL_TOKENS = MAX_PROMPT_TOKEN_IDS  # ids in one detokenize call, and in one tokenize reply

CallIds = Annotated[list[TokenId], Field(max_length=MAX_CALL_TOKENS)]


class TokenizeCall(BaseModel):
    """One call. `tokenize`: `prompt` (with the tokenizer's special tokens when `add_special_tokens`) or
    `messages` (the chat template, its generation prompt when `add_generation_prompt`; `tools` as a request
    with them shows them); `detokenize`: `tokens`."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["tokenize", "detokenize"]
    prompt: Content | None = None
    messages: Annotated[list[Message], Field(min_length=1)] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS), AfterValidator(shallow)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message left open, as a request continues it
    return_token_strs: bool = False
    tokens: CallIds | None = None
    deadline: float = 0.0  # unix s: past it, the caller no longer waits
    # whose tokenizer: a served model's queue name (shared/served.py); None the default model's
    base_model: Annotated[str, Field(max_length=64)] | None = None

    def to_wire(self) -> bytes:
        return orjson.dumps(self.model_dump(exclude_defaults=True, mode="json"))

    @classmethod
    def from_wire(cls, raw: bytes | str) -> TokenizeCall:
        """The call as the API wrote it; ValueError when it is not one (validated: calls are small)."""
        try:
            return cls.model_validate_json(raw)
        except ValidationError as exc:
            raise ValueError(f"not a tokenize call: {exc.errors()[0].get('msg', 'invalid')}") from None

    def prompt_chars(self) -> int:
        """The characters of its text, as a job's are counted (`shared.schemas.prompt_chars`)."""
        return prompt_chars(self.prompt, self.messages, self.tools)

    @property
    def expired(self) -> bool:
        return bool(self.deadline) and time.time() > self.deadline


class TokenizeReply(BaseModel):
    """A call's answer: what was asked for, or `error` (with the request field it concerns in `param`)."""

    tokens: list[int] | None = None
    token_strs: list[str] | None = None
    prompt: str | None = None
    error: str | None = None
    param: str | None = None

    def to_wire(self) -> bytes:
        return orjson.dumps(self.model_dump(exclude_none=True))

    @classmethod
    def from_wire(cls, raw: bytes | str) -> TokenizeReply:
        return cls.model_validate(_object(raw))


def _object(raw: bytes | str) -> dict[str, Any]:
    data = orjson.loads(raw)
    if not isinstance(data, dict):
        raise ValueError("a tokenize reply is a JSON object")
    return data
