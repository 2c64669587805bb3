"""Every bound a generation request must keep, in one place, as annotated field types.

The API's request models (`shared.schemas.GenerationRequest`, `api.openai_schemas`) are built from
these types, so the bounds are enforced at the door and appear in the OpenAPI schema. Bounds that
depend on the deployment (the vocabulary, MAX_TOKENS_CAP, MAX_PROMPT_CHARS) are a `Deployment`,
which `GenerationRequest.bounded` applies at the door too. The one rule that needs token counts
(the prompt and max_tokens within the model's context, `context_problem`) is the tokenizer's.

Rules that change a value rather than refuse it:
- temperature below TEMPERATURE_FLOOR (0.01) is greedy (0): dividing logits by a tiny temperature
  overflows to inf, and the result is the arg-max anyway;
- top_p below TOP_P_FLOOR (0.001) is raised to it: the sampler always keeps the most likely token,
  so any smaller value means the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field

TEMPERATURE_FLOOR = 0.01
TEMPERATURE_MAX = 2.0
TOP_P_FLOOR = 0.001
INT32_MAX = 2**31 - 1
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # a signed or unsigned 64-bit seed; folded into [0, 2**63)
MAX_MESSAGES = 512
MAX_CONTENT_CHARS = 200_000  # per message or prompt; MAX_PROMPT_CHARS bounds their sum
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 32
MAX_NAME_CHARS = 256
MAX_URL_CHARS = 2048
MAX_BODY_BYTES = 2 * 2**20  # a larger request body answers 413 before it is parsed
PRIORITY_MIN, PRIORITY_MAX = -1000, 1000  # a job's priority within its tenant: lower runs first (vLLM's meaning)
WEIGHT_MIN, WEIGHT_MAX = 0.01, 100.0  # a tenant's fair-share weight (shared/fair_queue.py)
MAX_LOGPROBS = 20  # top alternatives per token (vLLM's limit; OpenAI's completions allow 5, chat 20)
MAX_CHOICES = 8  # `n`: choices per prompt
MAX_PROMPTS = 32  # prompts in one completions request; prompts x n at most MAX_PROMPT_JOBS
MAX_PROMPT_JOBS = 64  # jobs one OpenAI request may become (each choice of each prompt is a job)
MAX_PROMPT_TOKEN_IDS = 131_072  # a prompt given as token ids (MAX_PROMPT_CHARS bounds text prompts)
MAX_LOGIT_BIAS = 300  # entries (OpenAI's limit)
PENALTY_MIN, PENALTY_MAX = -2.0, 2.0  # presence and frequency (OpenAI's range)
REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX = 0.01, 10.0  # multiplicative; 1 is off (vLLM's definition)
BIAS_MIN, BIAS_MAX = -100.0, 100.0  # logit_bias values (OpenAI's range)
MAX_JSON_DEPTH = 64  # objects and arrays inside one another in a free-form JSON value (a tool's definition)


def shallow(value: object) -> object:
    """A free-form JSON value nested at most MAX_JSON_DEPTH deep (a deeper one passed the body's parse but not the
    JSON serializer's recursion limit on its way to Redis: a 500)."""
    level, depth = [value], 0
    while level:
        depth += 1
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"nested more than {MAX_JSON_DEPTH} levels deep")
        level = [v for item in level for v in (item.values() if isinstance(item, dict) else
                                               item if isinstance(item, list) else ()) if isinstance(v, dict | list)]
    return value


JsonValue = Annotated[object, AfterValidator(shallow)]  # any JSON, nested at most MAX_JSON_DEPTH deep


def clean_text(v: str) -> str:
    """Refuse what cannot travel as UTF-8 or would truncate C strings downstream."""
    if "\x00" in v:
        raise ValueError("text must not contain NUL characters")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (no lone surrogates)") from None
    return v


def http_url(v: str) -> str:
    """An http(s) URL with a host, without credentials, whitespace or control characters."""
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in v):
        raise ValueError("the URL must not contain whitespace or control characters")
    try:
        parts = urlsplit(v)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("the URL must be http:// or https:// with a host")
    if parts.username is not None or parts.password is not None:
        raise ValueError("the URL must not carry credentials (user:password@)")
    if port == 0:
        raise ValueError("the URL's port must be between 1 and 65535")
    return v


Text = Annotated[str, AfterValidator(clean_text)]
Content = Annotated[str, Field(max_length=MAX_CONTENT_CHARS), AfterValidator(clean_text)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS), AfterValidator(clean_text)]
# OpenAI's `metadata`: up to 16 pairs, keys of 64 characters at most, values of 512
Metadata = Annotated[dict[Annotated[str, Field(max_length=64), AfterValidator(clean_text)],
                          Annotated[str, Field(max_length=512), AfterValidator(clean_text)]], Field(max_length=16)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS), AfterValidator(clean_text)]
StopList = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
StopTokenIds = Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]
MaxTokens = Annotated[int, Field(ge=1, le=INT32_MAX)]
Temperature = Annotated[float, Field(ge=0.0, le=TEMPERATURE_MAX, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
MinP = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]  # vLLM's: 0 is off
TopK = Annotated[int, Field(ge=-1, le=INT32_MAX), AfterValidator(lambda k: max(k, 0))]  # -1 (vLLM's), 0: all
Seed = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)]
Priority = Annotated[int, Field(ge=PRIORITY_MIN, le=PRIORITY_MAX)]
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
Penalty = Annotated[float, Field(ge=PENALTY_MIN, le=PENALTY_MAX, allow_inf_nan=False)]
RepetitionPenalty = Annotated[float, Field(ge=REPETITION_PENALTY_MIN, le=REPETITION_PENALTY_MAX, allow_inf_nan=False)]
LogitBias = Annotated[dict[TokenId, Annotated[float, Field(ge=BIAS_MIN, le=BIAS_MAX, allow_inf_nan=False)]],
                      Field(max_length=MAX_LOGIT_BIAS)]
MinTokens = Annotated[int, Field(ge=0, le=INT32_MAX)]
PromptTokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKEN_IDS)]
WebhookUrl = Annotated[str, Field(max_length=MAX_URL_CHARS), AfterValidator(clean_text), AfterValidator(http_url)]


def effective_temperature(t: float) -> float:
    return 0.0 if t < TEMPERATURE_FLOOR else t


def effective_top_p(p: float) -> float:
    return max(p, TOP_P_FLOOR)


def url_port(url: str) -> int:
    """The port an http(s) URL reaches: the one it names, else its scheme's (80, 443)."""
    parts = urlsplit(url)
    return parts.port or (443 if parts.scheme == "https" else 80)


def webhook_port_refusal(url: str, ports: frozenset[int]) -> str | None:
    """Why a webhook URL names a port this deployment does not send to (None: it may; no ports: any)."""
    port = url_port(url)
    if not ports or port in ports:
        return None
    return f"port {port} is not one webhooks are sent to here ({', '.join(map(str, sorted(ports)))}: WEBHOOK_PORTS)"


class LimitError(ValueError):
    """A request past one of the deployment's bounds: the HTTP status it answers and the field it names."""

    def __init__(self, message: str, param: str, status: int = 422) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


@dataclass(frozen=True)
class Deployment:
    """The bounds a deployment sets on top of the fixed ones (from its settings and its model's config.json)."""

    default_max_tokens: int = 256  # max_tokens of a request that gives none
    max_tokens_cap: int = 4096
    max_prompt_chars: int = 200_000  # a prompt of more text answers 413
    vocab_size: int | None = None  # token ids a request may name are below it (None: unknown, unchecked)
    webhook_ports: frozenset[int] = frozenset()  # the ports a webhook_url may name (empty: any)


def context_problem(prompt_tokens: int, max_tokens: int, context: int) -> str | None:
    """Why a tokenized prompt cannot run in a context of `context` tokens (None: it can), in vLLM's words (clients
    recognize a prompt too long by "maximum context length")."""
    if prompt_tokens == 0:
        return "the prompt is empty after tokenization"
    if prompt_tokens + max_tokens > context:
        return (f"This model's maximum context length is {context} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
                "completion). Please reduce the length of the messages or completion.")
    return None


def fitted_max_tokens(prompt_tokens: int, max_tokens: int, min_tokens: int, context: int) -> int:
    """A defaulted max_tokens (the request gave none) lowered to what the context leaves after the prompt, as vLLM
    defaults it, but never below min_tokens nor 1 (the prompt then does not fit: `context_problem` says so)."""
    return max(min(max_tokens, context - prompt_tokens), min_tokens, 1)
