"""vLLM's `/tokenize` and `/detokenize`, answered by the tokenizer pool through a tokenize call
(shared/tokenize_calls.py says the mechanism); `ask` is that call's API side, which the Messages API's
`count_tokens` uses too."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from typing import Annotated, Any

import redis.asyncio as aredis
from fastapi import APIRouter, Response
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from api import models as served
from api.auth import CallerDep
from api.deps import RedisDep, RelayDep, SettingsDep
from api.errors import ApiError
from api.openai_schemas import ChatMessage
from api.quota import take_request
from api.relay import Relay
from shared import names
from shared.grammar.tools import MAX_TOOLS
from shared.limits import MAX_MESSAGES, Content, Name, shallow
from shared.model_config import model_context
from shared.ring import channel_of
from shared.tokenize_calls import (
    CALL_TIMEOUT_S,
    POLL_S,
    STREAM_MAXLEN,
    CallIds,
    TokenizeCall,
    TokenizeReply,
)

router = APIRouter(tags=["tokenize"])


def bounded(call: TokenizeCall, max_chars: int) -> TokenizeCall:
    """The call, or 413 for one of more text than a job's prompt may have (`max_chars`, MAX_PROMPT_CHARS): each call
    takes a tokenizer's loop, which jobs share, for the time its text takes."""
    if (size := call.prompt_chars()) > max_chars:
        raise ApiError(413, f"the prompt has {size} characters; the limit is {max_chars}",
                       param="messages" if call.messages else "prompt")
    return call


async def ask(client: aredis.Redis, relay: Relay, call: TokenizeCall,
              timeout_s: float = CALL_TIMEOUT_S) -> TokenizeReply:
    """The tokenizer pool's reply to `call` (`bounded` already); 503 when none comes within `timeout_s`, 400 naming
    the field when the call could not be answered."""
    p = random.randrange(names.partition_count())
    call_id = names.tokenize_call_id(p, uuid.uuid4().hex)
    call = call.model_copy(update={"deadline": time.time() + timeout_s})
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    try:  # the whole call within its timeout, a slow subscribe or Redis call included
        async with asyncio.timeout(timeout_s):
            sub = await relay.subscribe(call_id)
    except TimeoutError:
        raise _unanswered(timeout_s) from None
    try:
        async with asyncio.timeout_at(deadline):
            pipe = client.pipeline(transaction=False)  # the append, and a sleeping tokenizer's flag (shared/ring.py)
            pipe.xadd(names.stream(names.TOKENIZE, p), {"call_id": call_id, "call": call.to_wire()},
                      maxlen=STREAM_MAXLEN, approximate=True)
            ring = names.ring_key(p, names.TOKENIZER_GROUP)
            pipe.getdel(ring)
            _, flag = await pipe.execute()
            if channel := channel_of(flag):
                await client.publish(channel, ring)
            while (left := deadline - loop.time()) > 0:
                raw: bytes | str | None = None
                try:
                    async with asyncio.timeout(min(left, POLL_S)):
                        raw = await sub.get()
                except TimeoutError:
                    pass
                raw = raw or await client.get(names.tokenize_reply_key(call_id))
                if raw:
                    return _answered(TokenizeReply.from_wire(raw))
    except TimeoutError:
        pass
    finally:
        await relay.unsubscribe(sub)
    raise _unanswered(timeout_s)


def _unanswered(timeout_s: float) -> ApiError:
    return ApiError(503, f"no tokenizer answered within {timeout_s:g} s; retry shortly", headers={"Retry-After": "1"})


def _answered(reply: TokenizeReply) -> TokenizeReply:
    if reply.error is not None:
        raise ApiError(400, reply.error, param=reply.param)
    return reply


class TokenizeRequest(BaseModel):
    """vLLM's two forms: a `prompt`, or chat `messages` (through the chat template)."""

    model_config = ConfigDict(extra="forbid",
                              json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})
    model: Name | None = None
    prompt: Content | None = None
    # as the chat route takes them: text or text parts, an assistant's tool_calls, a tool's tool_call_id
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS), AfterValidator(shallow)] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (as vLLM)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message left open, as a request continues it
    return_token_strs: bool = False

    def call(self, model: str | None = None) -> TokenizeCall:
        """The call for the tokenizer of `model` (a served model's queue name; None the default)."""
        if (self.prompt is None) == (self.messages is None):
            raise ApiError(400, "give exactly one of 'prompt' or 'messages'", param="prompt")
        messages = None if self.messages is None else [m.to_message(i) for i, m in enumerate(self.messages)]
        if self.continue_final_message and (self.add_generation_prompt or not messages
                                            or messages[-1].role != "assistant"):
            raise ApiError(400, "continue_final_message needs a last message from the assistant and "
                                "add_generation_prompt: false", param="continue_final_message")
        special = self.add_special_tokens if self.add_special_tokens is not None else self.messages is None
        return TokenizeCall(kind="tokenize", prompt=self.prompt, messages=messages, tools=self.tools,
                            add_special_tokens=special, add_generation_prompt=self.add_generation_prompt,
                            continue_final_message=self.continue_final_message,
                            return_token_strs=self.return_token_strs, base_model=model)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Name | None = None
    tokens: CallIds


class DetokenizeResponse(BaseModel):
    prompt: str


@router.post("/tokenize", response_model=TokenizeResponse, response_model_exclude_none=True)
async def tokenize(body: TokenizeRequest, client: RedisDep, relay: RelayDep, settings: SettingsDep,
                   caller: CallerDep, response: Response) -> Any:
    """The prompt's or the chat's token ids, as the model's tokenizer gives them."""
    target = await served.resolve(client, settings, body.model, caller.tenant)  # an adapter's tokenizer: its model's
    call = bounded(body.call(target.key(settings)), settings.max_prompt_chars)
    await take_request(client, caller, response)
    reply = await ask(client, relay, call)
    tokens = reply.tokens or []
    context = model_context(settings.path_of(target.model), settings.max_model_len)
    return TokenizeResponse(count=len(tokens), max_model_len=context,
                            tokens=tokens, token_strs=reply.token_strs)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, client: RedisDep, relay: RelayDep, settings: SettingsDep,
                     caller: CallerDep, response: Response) -> Any:
    """The text of token ids."""
    target = await served.resolve(client, settings, body.model, caller.tenant)  # an adapter's tokenizer: its model's
    await take_request(client, caller, response)
    reply = await ask(client, relay, TokenizeCall(kind="detokenize", tokens=body.tokens,
                                                  base_model=target.key(settings)))
    return DetokenizeResponse(prompt=reply.prompt or "")
