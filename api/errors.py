"""Errors as values clients can act on: `{"error": {"type", "message"}}` with the right status."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("conveyor.api")

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         409: "conflict_error", 413: "request_too_large", 422: "invalid_request_error",
         429: "rate_limit_error", 503: "service_unavailable", 500: "internal_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type_ or TYPES.get(status, "error")
        self.param, self.headers = param, headers


def error_body(status: int, message: str, type_: str | None = None, param: str | None = None) -> dict[str, object]:
    err: dict[str, object] = {"type": type_ or TYPES.get(status, "error"), "message": message}
    if param is not None:
        err["param"] = param
    err["code"] = None
    return {"error": err}


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
        return JSONResponse(error_body(exc.status, exc.message, exc.type, exc.param), exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = _validation_message(exc)
        return JSONResponse(error_body(422, msg, param=param), 422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), exc.status_code, headers=exc.headers)

    @app.exception_handler(RedisConnectionError)
    @app.exception_handler(RedisTimeoutError)
    async def _redis(_: Request, exc: Exception) -> JSONResponse:
        log.warning("redis unavailable: %s", exc)
        return JSONResponse(error_body(503, "the job store is unavailable; retry shortly"), 503,
                            headers={"Retry-After": "2"})

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(error_body(500, "internal error"), 500)
