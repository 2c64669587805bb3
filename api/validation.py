"""The door: what a generation request must keep beyond its schema, for every route that accepts one
(`/v1/jobs`, `/v1/chat/completions`, `/v1/completions`).

The rules are the request's own (`GenerationRequest.bounded`, shared/schemas.py); this module states the
deployment's bounds (shared.limits.Deployment): MAX_TOKENS_CAP, MAX_PROMPT_CHARS and the model's
vocabulary, read from its config.json (the API never loads a tokenizer)."""

from __future__ import annotations

import logging
from typing import Any

from api.errors import ApiError
from shared.limits import Deployment, LimitError
from shared.model_config import vocab_size
from shared.schemas import GenerationRequest
from shared.settings import Settings

log = logging.getLogger("conveyor.api")


def deployment(settings: Settings, model: str | None = None) -> Deployment:
    """The bounds of a request for `model` (a served model's queue name; None the default), its vocabulary's."""
    return Deployment(default_max_tokens=settings.default_max_tokens, max_tokens_cap=settings.max_tokens_cap,
                      max_prompt_chars=settings.max_prompt_chars, vocab_size=vocab_size(settings.path_of(model)),
                      webhook_ports=settings.webhook_port_set)


def check_request(req: GenerationRequest, settings: Settings,
                  sent_as: dict[str, str] | None = None) -> GenerationRequest:
    """Apply server defaults and the deployment's bounds for the model the request runs on (its `base_model`, set
    by `Target.apply` before); 413/422 with the offending field, by the name the client sent it under (`sent_as`:
    e.g. max_tokens came as max_completion_tokens)."""
    try:
        return req.bounded(deployment(settings, req.base_model))
    except LimitError as exc:
        param = (sent_as or {}).get(exc.param, exc.param)
        message = param + exc.message.removeprefix(exc.param) if exc.message.startswith(exc.param) else exc.message
        raise ApiError(exc.status, message, param=param) from None


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
    sizes = [v for m in settings.served.values() if (v := vocab_size(m.path)) is not None]
    vocab = max(sizes) if sizes else None  # the largest of the models served (the door checks each its own)
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
_ONLY: dict[str, dict[str, Any]]
_ONLY = {"functions": {"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}]},
         "function_call": {"enum": [None]}, "suffix": {"enum": ["", None]}}


def _document_openai(comps: dict[str, Any], settings: Settings) -> None:
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        model = comps.get(name)
        if not model:
            continue
        props = model["properties"]
        served = [*settings.served, *settings.loras]  # (and adapters loaded at run time: /v1/models)
        props["model"] = {"anyOf": [{"type": "string", "enum": served}, {"type": "null"}], "title": "Model"}
        for field, only in _ONLY.items():
            if field in props:
                props[field] = {"title": props[field].get("title", field), **only}
    if "ChatMessage" in comps:
        comps["ChatMessage"]["properties"]["role"]["enum"] = ["system", "developer", "user", "assistant", "tool"]
    if "ContentPart" in comps:
        comps["ContentPart"]["properties"]["type"] = {"type": "string", "enum": ["text"], "title": "Type"}
