"""One OpenTelemetry trace per job, across the processes it crosses.

On only when an OTLP endpoint is configured, by OpenTelemetry's own settings (`OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`; `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` turn it off). The
SDK reads the rest itself: `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER` and its arg,
`OTEL_BSP_*`, the exporter's headers and timeouts. Off, `setup` starts nothing (no provider, no exporter thread)
and every function here returns at its first line.

A job's trace context travels as a carrier: its W3C `traceparent`, and `tracestate` after a newline when there
is one. The API takes the client's from the request's headers (or starts a trace) and keeps the carrier in the
job's record (`trace`); the tokenizer pool passes it on in the `tokenized` record; each stage's span is a child
of the API's span for the request that submitted the job. A carrier is written only for a sampled trace, so a
job that is not traced costs the stages nothing but an empty string.

Stages that happen in a busy loop (the engine's) are not traced there: they are recorded after the fact, with
their own start and end times (`record`), by the lane that learns of them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

log = logging.getLogger("conveyor.tracing")

_tracer: Any = None  # the process's tracer once `setup` turned tracing on

Event = tuple[str, float, Mapping[str, Any]]  # (name, unix time s, attributes)


def configured(env: Mapping[str, str] = os.environ) -> bool:
    """Whether OpenTelemetry's settings ask for traces to be exported."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() in ("none", ""):
        return False
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def setup(process: str) -> bool:
    """Turn tracing on in this process when it is configured: a tracer provider (the SDK's sampler from
    OTEL_TRACES_SAMPLER), a batch processor and the OTLP/HTTP exporter. `process` is the kind of process
    (`conveyor.process` on every span's resource); the service is OTEL_SERVICE_NAME, else "conveyor"."""
    global _tracer
    if _tracer is not None or not configured():
        return _tracer is not None
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or "conveyor",
                                "conveyor.process": process, "process.pid": os.getpid()})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _tracer = trace.get_tracer("conveyor")
    log.info("tracing on: %s spans to %s", process, os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
             or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    return True


def enabled() -> bool:
    return _tracer is not None


SHUTDOWN_S = 2.0  # the most a process that ends waits for its last spans to go out


def shutdown() -> None:
    """Export what is pending (a process that ends), for SHUTDOWN_S at most: a collector that does not answer would
    hold the process for the exporter's own timeout (10 s), out of its stop's grace period."""
    if _tracer is None:
        return
    import threading

    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):
        done = threading.Thread(target=provider.shutdown, name="trace-shutdown", daemon=True)
        done.start()
        done.join(SHUTDOWN_S)
        if done.is_alive():
            log.warning("spans not all exported at exit: the collector did not answer within %g s", SHUTDOWN_S)


def _context(carrier: str) -> Any:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    parent, _, state = carrier.partition("\n")
    return TraceContextTextMapPropagator().extract({"traceparent": parent, **({"tracestate": state} if state else {})})


def carrier() -> str:
    """The current span's context as a carrier, '' when tracing is off or the current trace is not sampled."""
    if _tracer is None:
        return ""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    if not trace.get_current_span().get_span_context().trace_flags.sampled:
        return ""
    out: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(out)
    return out.get("traceparent", "") + ("\n" + out["tracestate"] if out.get("tracestate") else "")


def trace_id() -> str:
    """The current trace's id (32 hex digits), '' when there is none."""
    if _tracer is None:
        return ""
    from opentelemetry import trace

    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""


def annotate(attributes: Mapping[str, Any]) -> None:
    """Attributes on the current span (the API's, for the request being answered)."""
    if _tracer is None:
        return
    from opentelemetry import trace

    trace.get_current_span().set_attributes(_known(attributes))


def record(name: str, parent: str, start: float, end: float, attributes: Mapping[str, Any] | None = None,
           events: Iterable[Event] = ()) -> None:
    """A span that already happened (unix seconds), as a child of the carrier `parent`; nothing when tracing is
    off or the job carries no trace."""
    if _tracer is None or not parent:
        return
    span = _tracer.start_span(name, context=_context(parent), start_time=int(start * 1e9),
                              attributes=_known(attributes or {}))
    for event, at, attrs in events:
        span.add_event(event, dict(attrs), timestamp=int(at * 1e9))
    span.end(end_time=int(max(end, start) * 1e9))


def _known(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """The attributes that have a value (OpenTelemetry takes no None)."""
    return {k: v for k, v in attributes.items() if v is not None}
