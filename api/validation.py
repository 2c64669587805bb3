"""The door: what a generation request must keep beyond its schema (shared.limits), for every
route that accepts one (`/v1/jobs`, `/v1/chat/completions`, `/v1/completions`).

The schema holds the fixed bounds; this module adds the ones that depend on the deployment: the
model's vocabulary (read from its config.json: the API never loads a tokenizer), MAX_TOKENS_CAP
and MAX_PROMPT_CHARS."""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from pathlib import Path

from api.errors import ApiError
from shared.schemas import GenerationRequest
from shared.settings import Settings

log = logging.getLogger("conveyor.api")


@lru_cache(maxsize=8)
def vocab_size(model_path: str) -> int | None:
    """The model's vocabulary size from its config.json, or None when the API cannot see it."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
        size = cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size")
        return int(size) if size else None
    except (OSError, ValueError, AttributeError, TypeError):
        log.warning("no vocabulary size in %s/config.json: token ids are checked against int32 only", model_path)
        return None


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
        bad = [t for t in req.stop_token_ids if t >= vocab]
        if bad:
            raise ApiError(422, f"stop_token_ids must be below the vocabulary size {vocab}; got {bad[0]}",
                           param="stop_token_ids")
    return req
