"""Errors as values clients can act on: `{"error": {"type", "message"}}` with the right status; on the Anthropic
Messages routes (`/v1/messages...`) in Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from redis.exceptions import OutOfMemoryError
from starlette.exceptions import HTTPException as StarletteHTTPException

from shared.job_ops import NotCopied
from shared.jobs import DamagedRecord
from shared.redis_client import UNAVAILABLE
from shared.redis_errors import WritesRefusedError

log = logging.getLogger("conveyor.api")

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         409: "conflict_error", 413: "request_too_large", 422: "invalid_request_error",
         429: "rate_limit_error", 503: "service_unavailable", 500: "internal_error"}


class ErrorDetail(BaseModel):
    type: str
    message: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every 4xx and 5xx answer."""

    error: ErrorDetail


# documented on every route: the errors any request can meet at the door or on the way
COMMON_ERRORS: dict[int | str, dict[str, object]] = {
    status: {"model": ErrorResponse, "description": text}
    for status, text in ((400, "Bad request"), (401, "Missing or invalid API key"), (413, "Body too large"),
                         (422, "Invalid request"), (429, "Over a limit; see Retry-After"),
                         (500, "Internal error"), (503, "Redis unavailable; retry"))
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type_ or TYPES.get(status, "error")
        self.param, self.headers, self.code = param, headers, code


def not_found(job_id: str) -> ApiError:
    return ApiError(404, f"no job {job_id!r}")


def too_many(message: str, retry_ms: int, headers: dict[str, str] | None = None,
             code: str = "rate_limit_exceeded") -> ApiError:
    """A 429 whose Retry-After is `retry_ms` rounded up to whole seconds (at least one)."""
    retry = str(max(1, math.ceil(retry_ms / 1000)))
    return ApiError(429, message, type_="rate_limit_error", code=code,
                    headers={"Retry-After": retry, **(headers or {})})


def _printable(text: str) -> str:
    """Echoed input may hold lone surrogates, which JSON cannot carry: escape them."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(status: int, message: str, type_: str | None = None, param: str | None = None,
               code: str | None = None) -> dict[str, object]:
    """The one error object every 4xx and 5xx carries (OpenAI's shape)."""
    return {"error": {"type": type_ or TYPES.get(status, "error"), "message": _printable(message),
                      "param": _printable(param) if param is not None else None, "code": code}}


# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors)
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
                   422: "invalid_request_error", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                   529: "overloaded_error"}
ANTHROPIC_PREFIX = "/v1/messages"
# the native API, whose invalid requests answer 422 (its contract); on every other route (OpenAI's, vLLM's and
# Anthropic's surfaces) an invalid request is a 400, as their own servers answer, which their SDKs raise as
# BadRequestError (a 422 is another class, UnprocessableEntityError, that code written for them does not catch)
UNPROCESSABLE_PREFIX = "/v1/jobs"


def anthropic_body(status: int, message: str) -> dict[str, object]:
    """Anthropic's error object: `{"type": "error", "error": {"type", "message"}}`."""
    kind = ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": _printable(message)}}


def _answer(request: Request, status: int, message: str, type_: str | None = None, param: str | None = None,
            code: str | None = None, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """The error response in the shape of the route the request was for."""
    if status == 422 and not request.url.path.startswith(UNPROCESSABLE_PREFIX):
        status = 400
    if request.url.path.startswith(ANTHROPIC_PREFIX):
        # a prompt too long is a 400 there too (Anthropic's 413 is the body's size)
        status = 400 if status == 413 and param else status
        if status == 503 or code == "server_overloaded":  # the service (not the key) is full or unavailable:
            status = 529  # Anthropic's overloaded_error, which its SDKs raise as OverloadedError
        if param and param not in message:
            message = f"{param}: {message}"
        return JSONResponse(anthropic_body(status, message), status, headers=headers)
    return JSONResponse(error_body(status, message, type_, param, code), status, headers=headers)


# the parts of a pydantic error's location that name a union's branch or a dict's key, not a field:
# `function-after[...]`, `list[str]`, `[key]`, `constrained-str`, `int`
_BRANCH = re.compile(r"[\[(]|^(constrained-)?(str|int|float|bool|bytes|none|dict|list)$")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The errors as one message, each under its field's path (a union's branches' errors joined under one), and
    the first path as the `param`."""
    by_where: dict[str, list[str]] = {}
    for e in exc.errors():
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        where = ".".join(loc[:1] + [x for x in loc[1:] if not _BRANCH.search(x)])
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        if e.get("type") == "json_invalid":
            return f"the body is not valid JSON: {e.get('ctx', {}).get('error', msg)}", None
        said = by_where.setdefault(where, [])
        if msg not in said:
            said.append(msg)
    parts = [f"{where}: {' or '.join(msgs)}" if where else " or ".join(msgs) for where, msgs in by_where.items()]
    return "; ".join(parts) or "invalid request", next((w for w in by_where if w), None)


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError) -> JSONResponse:
        return _answer(request, exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

    @app.exception_handler(DamagedRecord)
    async def _damaged(request: Request, exc: DamagedRecord) -> JSONResponse:
        # a record a failover left half written can never complete: answered as a job that is gone
        log.warning("%s", exc)
        msg = f"{exc}: part of it was lost (as a Redis failover can do) and it cannot complete; submit it again"
        return _answer(request, 404, msg, code="incomplete_record")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        kind = request.headers.get("content-type", "")
        if "json" not in kind.lower() and any(tuple(e.get("loc", ())) == ("body",) for e in exc.errors()):
            # (`curl -d '{...}'` sends a form): not "should be a valid dictionary"
            msg = f"the body must be JSON, sent with Content-Type: application/json (this one: {kind or 'none'})"
            return _answer(request, 422, msg, "invalid_request_error")
        msg, param = _validation_message(exc)
        return _answer(request, 422, msg, "invalid_request_error", param=param)

    @app.exception_handler(ValidationError)
    async def _invalid_inner(request: Request, exc: ValidationError) -> JSONResponse:
        msg, param = _validation_message(RequestValidationError(exc.errors()))
        return _answer(request, 422, msg, "invalid_request_error", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _answer(request, exc.status_code, str(exc.detail), headers=exc.headers)

    async def _redis(request: Request, exc: Exception) -> JSONResponse:
        log.warning("redis unavailable: %s", exc)
        msg = str(exc) if isinstance(exc, NotCopied) else "the job store is unavailable; retry shortly"
        return _answer(request, 503, msg, headers={"Retry-After": "2"})

    for kind in UNAVAILABLE:
        app.add_exception_handler(kind, _redis)

    @app.exception_handler(WritesRefusedError)
    async def _refused(request: Request, exc: WritesRefusedError) -> JSONResponse:
        log.warning("redis refuses writes: %s", exc)  # nothing was written (a script is refused at its first write)
        msg = "the job store cannot take writes now; retry shortly"
        return _answer(request, 503, msg, headers={"Retry-After": "2"})

    @app.exception_handler(OutOfMemoryError)
    async def _full(request: Request, exc: OutOfMemoryError) -> JSONResponse:
        log.warning("redis is full: %s", exc)  # nothing was written (a script is refused at its first write)
        return _answer(request, 503, "the job store is full; retry later", headers={"Retry-After": "10"})
    # anything else is answered 500 by the request guard (api/guard.py), which logs it with the request id
