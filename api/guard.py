"""The outermost layer of every request: an `X-Request-Id` on each response (the client's own,
when it sent a sane one), a body-size cap that answers 413 before anything parses the body, and,
when keys are required, the operator's pages (metrics, scaling, docs) kept to the internal port."""

from __future__ import annotations

import logging
import re
import uuid
from contextvars import ContextVar

import anyio
import orjson
from sse_starlette.sse import SendTimeoutError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import ANTHROPIC_PREFIX, anthropic_body, error_body
from api.files import MAX_FILE_BYTES as FILE_BYTES
from api.sse import SEND_TIMEOUT_S

log = logging.getLogger("conveyor.api")
request_id: ContextVar[str] = ContextVar("request_id", default="-")
_SANE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")

# A refused body (over the cap, or an upload without a Content-Length) is read and thrown away before the
# answer goes out, up to DRAIN_BYTES of body in all and for DRAIN_S at most. The answer says `Connection:
# close` and uvicorn (httptools and h11 alike) closes the socket as soon as it is sent; a close with unread
# bytes in the socket is a TCP reset, which destroys the 413 before a client that sends its whole body
# before it reads (urllib, http.client, most scripts) can read it. Past either bound the answer goes out at
# once and the connection closes, so a client that sends gigabytes costs a bounded read, not the body:
# nginx's lingering close (reading for up to 30 s) and Go's net/http (up to 256 KiB) bound it the same way.
# A client that waits for `100 Continue` has sent no body yet: it is answered at once.
DRAIN_BYTES = 16 * 2**20
DRAIN_S = 5.0


# served only on the internal port when auth is required (Prometheus, KEDA and operators reach them there)
INTERNAL_PATHS = ("/metrics", "/scaling", "/docs", "/redoc", "/openapi.json", "/dashboard", "/v1/load_lora_adapter",
                  "/v1/unload_lora_adapter")


def on_internal_port(scope: Scope, internal_port: int | None) -> bool:
    server = scope.get("server")
    return internal_port is None or (server is not None and server[1] == internal_port)


class RequestGuard:
    def __init__(self, app: ASGIApp, max_body_bytes: int, internal_port: int | None = None,
                 keys_required: bool = False) -> None:
        """`keys_required`: an upload (64 MiB at most) is read only for a valid key (the app's `keys`, KeyCache): the
        route's own check comes after its form is parsed, the whole file spooled to disk."""
        self.app, self.max_body, self.internal_port = app, max_body_bytes, internal_port
        self.keys_required = keys_required

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        rid = given if _SANE_ID.fullmatch(given) else uuid.uuid4().hex
        request_id.set(rid)
        scope.setdefault("state", {})["request_id"] = rid
        path = scope.get("path", "")
        rid_headers = [(b"x-request-id", rid.encode())]
        if path.startswith("/v1/messages"):  # Anthropic's SDKs read it as `request-id` (`_request_id`)
            rid_headers.append((b"request-id", rid.encode()))
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", []), *rid_headers]
            await send(message)

        try:
            await self._dispatch(scope, receive, send_with_id, headers, path)
        except Exception as exc:
            # answered here, not by Starlette's outermost handler, which re-raises once it has answered: uvicorn
            # then closes the connection under the answer, and a client that sent a body read a reset, not the 500
            if started:
                if isinstance(exc, SendTimeoutError):  # a client that stopped reading, let go (api/sse.py): a line,
                    log.info("request %s: its client read nothing for %g s; its stream was let go", rid,
                             SEND_TIMEOUT_S)  # not a traceback per such client (uvicorn closes the connection)
                    return
                raise  # a stream cut midway: the connection closes, and the client resumes
            log.error("unhandled error in request %s (%s %s)", rid, scope.get("method"), path, exc_info=exc)
            await self._reply(send_with_id, 500, f"internal error; quote request id {rid} when reporting it", path,
                              close=False)

    async def _dispatch(self, scope: Scope, receive: Receive, send_with_id: Send, headers: dict[bytes, bytes],
                        path: str) -> None:
        if self.internal_port is not None and path.startswith(INTERNAL_PATHS) and \
                not on_internal_port(scope, self.internal_port):
            await self._reply(send_with_id, 404, f"no route {path}", path)
            return
        if path == "/v1/files" and scope.get("method") == "POST" and self.keys_required and \
                not await _known_key(scope, headers):
            await self._reply(send_with_id, 401, "invalid, revoked or missing API key", path)  # its body left unread
            return
        length = headers.get(b"content-length")
        cap = FILE_BYTES if path == "/v1/files" else self.max_body  # an upload is streamed to Redis, not held
        sending = headers.get(b"expect", b"").lower() != b"100-continue"  # the body is on its way
        if length is None and path == "/v1/files" and headers.get(b"transfer-encoding") is not None:
            if not sending or await _drain(receive, 0):
                await self._reply(send_with_id, 411, "an upload needs a Content-Length", path)
            return
        if length is not None:
            if not length.isdigit() or int(length) > cap:
                drain = sending and length.isdigit() and int(length) <= DRAIN_BYTES
                if not drain or await _drain(receive, 0):
                    await self._too_large(send_with_id, path, length.isdigit(), cap)
                return
            await self.app(scope, receive, send_with_id)
            return
        if headers.get(b"transfer-encoding") is None:
            await self.app(scope, receive, send_with_id)  # no body
            return
        await self._unknown_length(scope, receive, send_with_id, path)

    async def _unknown_length(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        """A body of unknown length (chunked): read up to the cap, then replayed to the app; past the cap, 413."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body:
                if not message.get("more_body", False) or await _drain(receive, size):
                    await self._too_large(send, path, True)
                return
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send, path: str, valid: bool, cap: int | None = None) -> None:
        await self._reply(send, 413 if valid else 400, f"the request body is larger than {cap or self.max_body} bytes"
                          if valid else "Content-Length must be a number", path)

    async def _reply(self, send: Send, status: int, msg: str, path: str, close: bool = True) -> None:
        """The error in the shape of the route asked for: Anthropic's on the Messages API, else OpenAI's. `close`:
        the connection closes after it (a refused body may be left unread)."""
        shaped = anthropic_body(status, msg) if path.startswith(ANTHROPIC_PREFIX) else error_body(status, msg)
        body = orjson.dumps(shaped)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                *([(b"connection", b"close")] if close else [])]})
        await send({"type": "http.response.body", "body": body})


def bearer_of(authorization: str, x_api_key: str) -> str | None:
    """The key a request carries: `Authorization: Bearer <key>`, or `x-api-key` (Anthropic's clients send it so)."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return x_api_key.strip() or None


async def _known_key(scope: Scope, headers: dict[bytes, bytes]) -> bool:
    """Whether the request carries a key of a tenant (one that is not revoked)."""
    key = bearer_of(headers.get(b"authorization", b"").decode("latin-1"),
                    headers.get(b"x-api-key", b"").decode("latin-1"))
    return key is not None and await scope["app"].state.keys.lookup(key) is not None


async def _drain(receive: Receive, read: int) -> bool:
    """Read and drop the rest of a refused body (`read` bytes of it read already) within DRAIN_BYTES and
    DRAIN_S; False when the client went away meanwhile (nobody to answer)."""
    with anyio.move_on_after(DRAIN_S):
        while read <= DRAIN_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                return False
            read += len(message.get("body", b""))
            if not message.get("more_body", False):
                break
    return True
