"""A real OTLP/HTTP trace receiver in a thread: it decodes each export (protobuf, as OpenTelemetry's exporter
sends it) and keeps every span, with its process's resource attributes; or, as a benchmark's stand-in for a
collector on another machine, only counts the exports and their bytes (`decode=False`)."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start: float
    end: float
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    resource: dict[str, Any]
    kind: int


def _value(v: Any) -> Any:
    field = v.WhichOneof("value")
    if field == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, field) if field else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


class Spans:
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.arrived = threading.Condition()
        self.url = ""
        self.exports = 0
        self.bytes = 0

    def take(self, body: bytes) -> None:
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        got = []
        for rs in req.resource_spans:
            resource = _attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(Span(s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                    s.start_time_unix_nano / 1e9, s.end_time_unix_nano / 1e9, _attrs(s.attributes),
                                    [(e.name, _attrs(e.attributes)) for e in s.events], resource, s.kind))
        with self.arrived:
            self.spans += got
            self.arrived.notify_all()

    def wait_for(self, condition: Callable[[list[Span]], bool], timeout: float) -> list[Span]:
        """The spans so far once `condition` holds of them; AssertionError with what arrived when it does not."""
        with self.arrived:
            if not self.arrived.wait_for(lambda: condition(self.spans), timeout):
                raise AssertionError(f"spans so far: {[(s.name, s.trace_id) for s in self.spans]}")
            return list(self.spans)

    def of_trace(self, trace_id: str) -> list[Span]:
        with self.arrived:
            return [s for s in self.spans if s.trace_id == trace_id]


@contextmanager
def otlp_receiver(decode: bool = True) -> Iterator[Spans]:
    """On 127.0.0.1; `Spans.url` is the endpoint to give as OTEL_EXPORTER_OTLP_ENDPOINT."""
    spans = Spans()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            spans.exports, spans.bytes = spans.exports + 1, spans.bytes + len(body)
            if self.path == "/v1/traces" and decode:
                spans.take(body)
            reply = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    spans.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield spans
    finally:
        server.shutdown()
        server.server_close()
