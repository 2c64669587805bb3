"""Errors as values clients can act on: `{"error": {"type", "message"}}` with the right status."""

from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from shared.job_ops import NotCopied
from shared.jobs import DamagedRecord
from shared.redis_client import UNAVAILABLE

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


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for e in exc.errors():
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        param = param or where or None
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        if e.get("type") == "json_invalid":
            return f"the body is not valid JSON: {e.get('ctx', {}).get('error', msg)}", None
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts) or "invalid request", param


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError) -> JSONResponse:
        body = error_body(exc.status, exc.message, exc.type, exc.param, exc.code)
        return JSONResponse(body, exc.status, headers=exc.headers)

    @app.exception_handler(DamagedRecord)
    async def _damaged(_: Request, exc: DamagedRecord) -> JSONResponse:
        # a record a failover left half written can never complete: answered as a job that is gone
        log.warning("%s", exc)
        msg = f"{exc}: part of it was lost (as a Redis failover can do) and it cannot complete; submit it again"
        return JSONResponse(error_body(404, msg, code="incomplete_record"), 404)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = _validation_message(exc)
        return JSONResponse(error_body(422, msg, param=param), 422)

    @app.exception_handler(ValidationError)
    async def _invalid_inner(_: Request, exc: ValidationError) -> JSONResponse:
        msg, param = _validation_message(RequestValidationError(exc.errors()))
        return JSONResponse(error_body(422, msg, param=param), 422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), exc.status_code, headers=exc.headers)

    async def _redis(_: Request, exc: Exception) -> JSONResponse:
        log.warning("redis unavailable: %s", exc)
        msg = str(exc) if isinstance(exc, NotCopied) else "the job store is unavailable; retry shortly"
        return JSONResponse(error_body(503, msg), 503,
                            headers={"Retry-After": "2"})

    for kind in UNAVAILABLE:
        app.add_exception_handler(kind, _redis)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # runs outside the request guard's send: it sets the request id header itself
        rid = request.scope.get("state", {}).get("request_id", "-")
        log.error("unhandled error in request %s (%s %s)", rid, request.method, request.url.path, exc_info=exc)
        return JSONResponse(error_body(500, f"internal error; quote request id {rid} when reporting it"), 500,
                            headers={"X-Request-Id": rid})
