"""A screenshot of one trace's page in Phoenix's UI (infra/phoenix.py), for the docs and for checking by eye
that a job's spans arrive as one tree.

    .venv/bin/python -m bench.phoenix_shot http://127.0.0.1:6006 TRACE_ID [--out trace.png]
    .venv/bin/python -m bench.phoenix_shot http://127.0.0.1:6006 --job JOB_ID [--out trace.png]
    .venv/bin/python -m bench.phoenix_shot http://127.0.0.1:6006 --synthetic [--start] [--out trace.png]

TRACE_ID is the trace's OpenTelemetry id (32 hex digits: the client's own when it sent a `traceparent`; the
API logs it as "job ... accepted: request ..., trace ..."); `--job` finds it by the job's id instead (the
spans' `conveyor.job.id`). `--synthetic` sends a trace of its own first, through shared/tracing.py, shaped as a
job's: the API's request span and each stage's span under it, with the names and attributes the service
records. `--start` runs a Phoenix of its own on the URL's port for the while (its data in `--workdir`, else in
a temporary directory).

The trace is found by Phoenix's GraphQL API (`getTraceByOtelId`: its project), waited for until it has
`--spans` spans (a job's spans arrive as its stages end), then its page, /projects/<project id>/traces/<trace
id>, is opened in Debian's headless chromium through chromedriver (as tests/api/test_dashboard.py does), and
shot once every span's name is on the page. Exits 1 when the trace or its tree does not show up in time (the
screenshot is still written).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
TRACE_ID = re.compile(r"^[0-9a-f]{32}$")
TRACE_QUERY = ("query($t: String!) { getTraceByOtelId(traceId: $t) { id traceId numSpans "
               "project { id name } } }")
SPANS_QUERY = ("query($t: String!, $n: Int!) { getTraceByOtelId(traceId: $t) { id traceId numSpans "
               "project { id name } spans(first: $n) { edges { node { name spanId parentId } } } } }")


def _post_json(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.load(resp)


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.load(resp)


def find_trace(base: str, trace_id: str) -> dict[str, Any] | None:
    """The trace as Phoenix's GraphQL API has it (its row id, span count and project), None when it has not."""
    reply = _post_json(f"{base}/graphql", {"query": TRACE_QUERY, "variables": {"t": trace_id}})
    if reply.get("errors"):
        raise RuntimeError(f"Phoenix's GraphQL API: {reply['errors']}")
    trace: dict[str, Any] | None = reply["data"]["getTraceByOtelId"]
    return trace


def trace_spans(base: str, trace_id: str, first: int = 1000) -> dict[str, Any] | None:
    """`find_trace`'s trace with its spans (GraphQL): under "spans", each one's `name`, `spanId` and `parentId`
    (OpenTelemetry ids in hex; `parentId` None for a root); None when Phoenix has no such trace."""
    reply = _post_json(f"{base}/graphql", {"query": SPANS_QUERY, "variables": {"t": trace_id, "n": first}})
    if reply.get("errors"):
        raise RuntimeError(f"Phoenix's GraphQL API: {reply['errors']}")
    trace: dict[str, Any] | None = reply["data"]["getTraceByOtelId"]
    if trace is not None:
        trace["spans"] = [edge["node"] for edge in trace["spans"]["edges"]]
    return trace


def trace_page(base: str, trace: dict[str, Any]) -> str:
    """The page of a trace found by `find_trace` or `trace_spans`: /projects/<project id>/traces/<trace id>."""
    return f"{base}/projects/{trace['project']['id']}/traces/{trace['traceId']}"


def span_names(base: str, project_id: str, trace_id: str) -> list[str]:
    """The trace's span names, from Phoenix's REST API."""
    query = urllib.parse.urlencode({"trace_id": trace_id, "limit": 1000})
    reply = _get_json(f"{base}/v1/projects/{urllib.parse.quote(project_id)}/spans?{query}")
    return [s["name"] for s in reply["data"]]


def trace_of_job(base: str, job_id: str, timeout: float) -> str | None:
    """The id of the trace a job's spans are in (Phoenix's REST API, the project `conveyor`), None if none in time."""
    from infra import phoenix

    query = urllib.parse.urlencode({"attribute": f"conveyor.job.id:{json.dumps(job_id)}", "limit": 1})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spans = _get_json(f"{base}/v1/projects/{phoenix.PROJECT}/spans?{query}")["data"]
        if spans:
            return str(spans[0]["context"]["trace_id"])
        time.sleep(0.5)
    return None


def wait_for_trace(base: str, trace_id: str, spans: int, timeout: float) -> dict[str, Any] | None:
    """Wait until Phoenix holds the trace with at least `spans` spans (spans arrive in batches, in any order)."""
    deadline = time.monotonic() + timeout
    trace = None
    while time.monotonic() < deadline:
        trace = find_trace(base, trace_id)
        if trace is not None and trace["numSpans"] >= spans:
            return trace
        time.sleep(0.5)
    return trace


def send_synthetic(base: str) -> tuple[str, int]:
    """A job's trace as the stack records it (shared/tracing.py, api/main.py, workers/tokenizer/worker.py,
    gpu_worker/job_trace.py, api/streaming.py), sent to `base`: (its trace id, its span count)."""
    from infra import phoenix

    os.environ.update(phoenix.otel_env(base))
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    from shared import tracing

    if not tracing.setup("bench"):
        raise SystemExit("tracing did not turn on")
    job, worker, tokens, out = "j0-" + os.urandom(8).hex(), "synthetic-1", 412, 96
    t0 = time.time() - 2.0
    root = trace.get_tracer("conveyor").start_span(
        "POST /v1/jobs", kind=trace.SpanKind.SERVER, start_time=int(t0 * 1e9),
        attributes={"http.request.method": "POST", "http.route": "/v1/jobs", "url.path": "/v1/jobs",
                    "http.response.status_code": 200, "conveyor.job.id": job, "conveyor.tenant": "demo",
                    "gen_ai.operation.name": "chat", "gen_ai.request.model": "synthetic",
                    "gen_ai.request.max_tokens": out, "conveyor.request_id": os.urandom(8).hex()})
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(root))
    parent = carrier["traceparent"]
    trace_id = format(root.get_span_context().trace_id, "032x")
    stage = {"conveyor.job.id": job, "conveyor.worker": worker}
    engine = {**stage, "conveyor.job.resumed": False}
    at = t0 + 0.004
    tracing.record("conveyor.queue.jobs", parent, at, at + 0.011, stage)
    tracing.record("conveyor.tokenize", parent, at + 0.011, at + 0.015,
                   {**stage, "gen_ai.usage.input_tokens": tokens, "conveyor.batch.jobs": 3})
    tracing.record("conveyor.queue.fair", parent, at + 0.015, at + 0.042, engine)
    tracing.record("conveyor.engine.wait", parent, at + 0.042, at + 0.058, engine)
    chunks = [("prefill_chunk", at + 0.058, {"conveyor.tokens": 256}), ("prefill_chunk", at + 0.120,
                                                                          {"conveyor.tokens": tokens - 256})]
    tracing.record("conveyor.prefill", parent, at + 0.058, at + 0.171,
                   {**engine, "gen_ai.usage.input_tokens": tokens, "conveyor.prefill.chunks": 2}, chunks)
    tracing.record("conveyor.decode", parent, at + 0.171, at + 1.62,
                   {**engine, "gen_ai.usage.input_tokens": tokens, "gen_ai.usage.output_tokens": out,
                    "gen_ai.response.finish_reasons": ["length"], "conveyor.preemptions": 1},
                   [("preempted", at + 0.9, {"conveyor.output_tokens": 41})])
    tracing.record("conveyor.output", parent, at + 0.172, at + 1.625, {**engine, "conveyor.output.writes": 24})
    tracing.record("conveyor.relay", parent, at + 0.002, at + 1.63,
                   {"conveyor.job.id": job, "conveyor.relay.events": out + 1, "conveyor.relay.after": 0,
                    "conveyor.relay.reached_done": True})
    root.end(end_time=int((at + 1.632) * 1e9))
    tracing.shutdown()  # exports what is pending
    return trace_id, 9


def chrome(profile: Path, width: int, height: int) -> Any:
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        raise SystemExit(f"{', '.join(missing)} missing: `make browser` installs Debian's chromium and "
                         "chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = str(CHROMIUM)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the page's console, for `shoot`'s failures
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--hide-scrollbars",
                f"--window-size={width},{height}", f"--user-data-dir={profile}"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=opts)
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",  # the page's size, not the window's
                           {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
    return driver


def shoot(page: str, names: list[str], out: Path, timeout: float, width: int, height: int) -> list[str]:
    """Open `page`, wait until every name in `names` is on it, save a PNG; the names still missing. A page
    still blank halfway through `timeout` (its script never ran: seen on a loaded machine) is loaded once more.
    When names are missing, the browser's console goes beside the PNG (`<out>.console.txt`)."""
    from selenium.webdriver.common.by import By

    with tempfile.TemporaryDirectory(prefix="phoenix-shot-") as tmp:
        driver = chrome(Path(tmp) / "profile", width, height)
        try:
            driver.get(page)
            start = time.monotonic()
            reloaded = False
            missing = list(names)
            while missing and time.monotonic() < start + timeout:
                try:
                    text = driver.find_element(By.TAG_NAME, "body").text
                except Exception:  # noqa: BLE001 - the page being replaced as it renders
                    text = ""
                missing = [n for n in names if n not in text]
                if not text.strip() and not reloaded and time.monotonic() > start + timeout / 2:
                    reloaded = True
                    driver.refresh()
                time.sleep(0.3)
            time.sleep(1.0)  # the last layout and fonts
            out.parent.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(str(out))
            if missing:
                console = driver.get_log("browser")
                out.with_suffix(".console.txt").write_text(
                    f"reloaded: {reloaded}\n" + "\n".join(f"{e.get('level')} {e.get('message')}" for e in console))
            return missing
        finally:
            driver.quit()


def start_phoenix(base: str, workdir: Path) -> subprocess.Popen[bytes]:
    """A Phoenix of its own on `base`'s port, answering; its data and log (phoenix.log) in `workdir`."""
    from infra import phoenix

    port = urllib.parse.urlsplit(base).port or phoenix.DEFAULT_PORT
    workdir.mkdir(parents=True, exist_ok=True)
    log = (workdir / "phoenix.log").open("wb")
    proc = subprocess.Popen(phoenix.phoenix_command(port, workdir), env=phoenix.phoenix_env(port, workdir),
                            stdout=log, stderr=subprocess.STDOUT)
    if not phoenix.wait_ready(port, 120):
        proc.terminate()
        proc.wait(30)
        raise SystemExit(f"Phoenix did not start on port {port}: see {workdir / 'phoenix.log'}")
    return proc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.phoenix_shot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url", help="Phoenix's URL, e.g. http://127.0.0.1:6006")
    p.add_argument("trace_id", nargs="?", help="the trace's OpenTelemetry id, 32 hex digits")
    p.add_argument("--job", help="the trace of this job (its id, e.g. job_0123...)")
    p.add_argument("--synthetic", action="store_true", help="send a job-shaped trace first and shoot that one")
    p.add_argument("--start", action="store_true", help="run a Phoenix of its own on the URL's port meanwhile")
    p.add_argument("--workdir", type=Path, default=None,
                   help="with --start: its data directory, kept (default: a temporary one, removed)")
    p.add_argument("--spans", type=int, default=1,
                   help="wait until the trace has this many spans (a job's: 9 once it ends; default 1)")
    p.add_argument("--out", type=Path, default=Path("trace.png"), help="the PNG to write (default trace.png)")
    p.add_argument("--width", type=int, default=1600)
    p.add_argument("--height", type=int, default=1000)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the trace, then its page")
    args = p.parse_args(argv)
    base = args.url.rstrip("/")
    if sum((bool(args.trace_id), bool(args.job), args.synthetic)) != 1:
        p.error("give one of: a trace id, --job, --synthetic")
    proc = None
    scratch = tempfile.TemporaryDirectory(prefix="phoenix-shot-data-") if args.start and not args.workdir else None
    if args.start:
        workdir = Path(scratch.name) if scratch is not None else args.workdir
        proc = start_phoenix(base, workdir)
        print(f"Phoenix started at {base}, its data in {workdir}")
    try:
        expected = args.spans
        if args.synthetic:
            trace_id, expected = send_synthetic(base)
            print(f"sent trace {trace_id} ({expected} spans)")
        elif args.job:
            found_id = trace_of_job(base, args.job, args.timeout)
            if found_id is None:
                print(f"Phoenix at {base} has no span of job {args.job}", file=sys.stderr)
                return 1
            trace_id = found_id
        else:
            trace_id = args.trace_id.strip().lower()
            if not TRACE_ID.match(trace_id):
                p.error(f"not a trace id (32 hex digits): {args.trace_id!r}")
        found = wait_for_trace(base, trace_id, expected, args.timeout)
        if found is None:
            print(f"Phoenix at {base} has no trace {trace_id}", file=sys.stderr)
            return 1
        if found["numSpans"] < expected:
            print(f"trace {trace_id}: {found['numSpans']} spans of {expected} after {args.timeout:.0f}s; "
                  "shooting what there is", file=sys.stderr)
        names = span_names(base, found["project"]["id"], trace_id)
        page = trace_page(base, found)
        print(f"trace {trace_id}: {found['numSpans']} spans in project {found['project']['name']!r}\n  {page}")
        missing = shoot(page, sorted(set(names)), args.out, args.timeout, args.width, args.height)
        print(f"screenshot: {args.out}")
        if missing:
            print(f"not on the page after {args.timeout:.0f}s: {', '.join(missing)}", file=sys.stderr)
            return 1
        return 0
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        if scratch is not None:
            scratch.cleanup()


if __name__ == "__main__":
    sys.exit(main())
