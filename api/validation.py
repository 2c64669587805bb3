"""The door: what a generation request must keep beyond its schema (shared.limits), for every
route that accepts one (`/v1/jobs`, `/v1/chat/completions`, `/v1/completions`).

The schema holds the fixed bounds; this module adds the ones that depend on the deployment: the
model's vocabulary (read from its config.json: the API never loads a tokenizer), MAX_TOKENS_CAP
and MAX_PROMPT_CHARS."""

from __future__ import annotations

import logging
from typing import Any

from api.errors import ApiError
from shared.model_config import vocab_size
from shared.schemas import GenerationRequest
from shared.settings import Settings

log = logging.getLogger("conveyor.api")


def check_request(req: GenerationRequest, settings: Settings) -> GenerationRequest:
    """Apply server defaults and the deployment's bounds; 413/422 with the offending field."""
    if "max_tokens" not in req.model_fields_set:
        req.max_tokens = settings.default_max_tokens
    if req.max_tokens > settings.max_tokens_cap:
        raise ApiError(422, f"max_tokens must be at most {settings.max_tokens_cap}", param="max_tokens")
    size = len(req.prompt or "") + sum(len(m.content) for m in req.messages or [])
    if size > settings.max_prompt_chars:
        raise ApiError(413, f"the prompt has {size} characters; the limit is {settings.max_prompt_chars}",
                       param="messages" if req.messages else "prompt")
    vocab = vocab_size(settings.model_path)
    if vocab is not None:
        if req.top_k > vocab:
            raise ApiError(422, f"top_k must be 0 (off) or at most the vocabulary size, {vocab}", param="top_k")
        for field, ids in (("stop_token_ids", req.stop_token_ids), ("logit_bias", list(req.logit_bias)),
                           ("prompt", req.prompt_token_ids or [])):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise ApiError(422, f"{field}: token ids must be below the vocabulary size {vocab}; got {bad}",
                               param=field)
    return req


def _vocab_bound(schema: dict[str, Any], vocab: int) -> None:
    """Every integer item (token id) anywhere in this property's schema: at most vocab - 1."""
    if schema.get("type") == "integer":
        schema["maximum"] = vocab - 1
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key, []):
            _vocab_bound(sub, vocab)
    if isinstance(schema.get("items"), dict):
        _vocab_bound(schema["items"], vocab)


def _not_null(prop: dict[str, Any]) -> dict[str, Any]:
    """The non-null part of a property that may also be null (the property itself otherwise)."""
    for branch in prop.get("anyOf", []):
        if branch.get("type") != "null":
            return branch  # type: ignore[no-any-return]
    return prop


def document_bounds(schema: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """State this deployment's bounds in its OpenAPI schema, so clients and schema-driven tools see
    what check_request enforces; and that a job takes exactly one of `prompt` or `messages`."""
    comps = schema.get("components", {}).get("schemas", {})
    vocab = vocab_size(settings.model_path)
    for name in ("GenerationRequest", "CompletionRequest", "ChatCompletionRequest"):
        props = comps.get(name, {}).get("properties", {})
        for field in ("max_tokens", "max_completion_tokens"):
            if field in props:
                _not_null(props[field])["maximum"] = settings.max_tokens_cap
        if vocab is not None:
            if "top_k" in props:
                _not_null(props["top_k"])["maximum"] = vocab
            if "stop_token_ids" in props:
                _not_null(props["stop_token_ids"])["items"]["maximum"] = vocab - 1
            for field in ("prompt_token_ids", "prompt"):  # token ids: below the vocabulary
                for branch in [props[field]] if field in props else []:
                    _vocab_bound(branch, vocab)
    _document_openai(comps, settings)
    job = comps.get("GenerationRequest")
    if job:
        for field in ("prompt", "messages"):  # present means not null; `oneOf` says which
            job["properties"][field] = _not_null(job["properties"][field])
        job["properties"]["prompt"]["maxLength"] = settings.max_prompt_chars
        job["oneOf"] = [{"required": ["prompt"]}, {"required": ["messages"]}]
    return schema


# OpenAI options this server refuses (with a 400 naming the option): the schema says which values pass
_ONLY = {"tools": {"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}]},
         "functions": {"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}]},
         "tool_choice": {"enum": ["none", None]}, "function_call": {"enum": [None]},
         "suffix": {"enum": ["", None]}}


def _document_openai(comps: dict[str, Any], settings: Settings) -> None:
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        model = comps.get(name)
        if not model:
            continue
        props = model["properties"]
        props["model"] = {"anyOf": [{"type": "string", "enum": [settings.served_model_name]}, {"type": "null"}],
                          "title": "Model"}
        for field, only in _ONLY.items():
            if field in props:
                props[field] = {"title": props[field].get("title", field), **only}
    if "ChatMessage" in comps:
        comps["ChatMessage"]["properties"]["role"]["enum"] = ["system", "developer", "user", "assistant"]
    if "ContentPart" in comps:
        comps["ContentPart"]["properties"]["type"] = {"type": "string", "enum": ["text"], "title": "Type"}
