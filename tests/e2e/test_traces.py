"""One OpenTelemetry trace per job: a stack exporting to a real OTLP receiver (tests/otlp_receiver.py) gives,
for a job submitted with a client's `traceparent`, one trace holding every stage's span from the API, the
tokenizer pool and the inference worker's output lane, each a child of the API's span for the submit."""

from __future__ import annotations

import io
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import redis

from harness.otlp_receiver import Span, Spans, otlp_receiver
from harness.stack import ROOT, Stack, start_stack, stop_stack, until
from shared import names
from shared.jobs import STAGES as JOB_STAGES

STAGES = ("conveyor.queue.jobs", "conveyor.tokenize", "conveyor.queue.fair", "conveyor.engine.wait",
          "conveyor.prefill", "conveyor.decode", "conveyor.output", "conveyor.relay")


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory, redis_server, tiny_model_dir: str,  # type: ignore[no-untyped-def]
           ) -> Iterator[tuple[Stack, Spans]]:
    url = redis_server.url.rsplit("/", 1)[0] + "/5"
    redis.Redis.from_url(url).flushdb()
    with otlp_receiver() as spans:
        s = start_stack(tmp_path_factory.mktemp("traced-stack"), url, tiny_model_dir,
                        extra={"OTEL_EXPORTER_OTLP_ENDPOINT": spans.url, "OTEL_BSP_SCHEDULE_DELAY": "100",
                               "OTEL_SERVICE_NAME": "conveyor-test", "LOG_LEVEL": "INFO",
                               "CLAIM_IDLE_MS": "2000"})  # a killed worker's job is taken on soon
        try:
            yield s, spans
        finally:
            stop_stack(s)


def _traceparent(sampled: bool = True) -> tuple[str, str, str]:
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{parent}-{'01' if sampled else '00'}", trace_id, parent


def _stream_to_done(url: str, headers: dict[str, str] | None = None) -> None:
    with httpx.stream("GET", url, headers=headers, timeout=60) as r:
        for line in r.iter_lines():
            if line == "event: done":
                return
    raise AssertionError("the stream ended without its done event")


def test_a_job_is_one_trace_through_every_stage(traced: tuple[Stack, Spans]) -> None:
    stack, spans = traced
    header, trace_id, client_span = _traceparent()
    sub = httpx.post(f"{stack.url}/v1/jobs", json={"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.5,
                                                   "seed": 3}, headers={"traceparent": header, "x-request-id": "rq-1"})
    assert sub.status_code == 202, sub.text
    job = sub.json()
    _stream_to_done(f"{stack.url}/v1/jobs/{job['id']}/events")  # no traceparent: the relay's span finds the job's
    got = spans.wait_for(lambda ss: {s.name for s in ss if s.trace_id == trace_id} >= {*STAGES, "POST /v1/jobs"}, 30)
    mine = [s for s in got if s.trace_id == trace_id]
    api = [s for s in mine if s.name == "POST /v1/jobs"]
    assert len(api) == 1 and api[0].parent_id == client_span  # the client's span is the submit's parent
    assert api[0].attributes["conveyor.job.id"] == job["id"]
    assert api[0].attributes["gen_ai.request.temperature"] == 0.5
    assert api[0].attributes["http.response.status_code"] == 202
    stage = {s.name: s for s in mine if s.name in STAGES}
    assert all(s.parent_id == api[0].span_id for s in stage.values())  # each stage a child of the submit
    assert {s.name: s.resource["conveyor.process"] for s in stage.values()} == {
        "conveyor.queue.jobs": "tokenizer", "conveyor.tokenize": "tokenizer", "conveyor.queue.fair": "output-lane",
        "conveyor.engine.wait": "output-lane", "conveyor.prefill": "output-lane", "conveyor.decode": "output-lane",
        "conveyor.output": "output-lane", "conveyor.relay": "api"}
    assert all(s.resource["service.name"] == "conveyor-test" for s in mine)
    # in order, each stage where the one before it ended (the clocks are one machine's)
    order = [stage[n] for n in STAGES[:6]]
    assert all(a.end <= b.start + 1e-3 for a, b in zip(order, order[1:])), [(s.name, s.start, s.end) for s in order]
    done = httpx.get(f"{stack.url}/v1/jobs/{job['id']}").json()
    decode = stage["conveyor.decode"].attributes
    assert decode["gen_ai.usage.output_tokens"] == done["usage"]["completion_tokens"]
    assert decode["gen_ai.usage.input_tokens"] == done["usage"]["prompt_tokens"]
    assert decode["gen_ai.response.finish_reasons"] == [done["finish_reason"]]
    assert [e for e, _ in stage["conveyor.prefill"].events] and \
        all(e == "prefill_chunk" for e, _ in stage["conveyor.prefill"].events)
    assert stage["conveyor.relay"].attributes["conveyor.relay.reached_done"] is True
    # the dashboard's timeline of the job, from its record's times, names the same trace
    timeline = httpx.get(f"{stack.url}/dashboard/jobs/{job['id']}/timeline").json()
    assert timeline["trace_id"] == trace_id
    assert [s["stage"] for s in timeline["stages"]] == [s for s, _, _ in JOB_STAGES]
    starts = [s["start"] for s in timeline["stages"]]
    assert starts == sorted(starts) and timeline["stages"][-1]["end"] == done["finished_at"]
    # the request's id and the trace's side by side in the API's log
    until("the log line", lambda: f"request rq-1, trace {trace_id}" in stack.log.read_text(), 10)


def test_a_streamed_chat_is_one_trace_from_the_door_to_its_last_chunk(traced: tuple[Stack, Spans]) -> None:
    stack, spans = traced
    header, trace_id, client_span = _traceparent()
    model = httpx.get(f"{stack.url}/v1/models").json()["data"][0]["id"]
    with httpx.stream("POST", f"{stack.url}/v1/chat/completions", headers={"traceparent": header}, timeout=60,
                      json={"model": model, "stream": True, "max_tokens": 8,
                            "messages": [{"role": "user", "content": "Hi"}]}) as r:
        assert r.status_code == 200
        assert "data: [DONE]" in list(r.iter_lines())
    door = "POST /v1/chat/completions"
    got = spans.wait_for(lambda ss: {s.name for s in ss if s.trace_id == trace_id} >= {*STAGES, door}, 30)
    root = next(s for s in got if s.trace_id == trace_id and s.name == door)
    assert root.parent_id == client_span
    [relay] = [s for s in got if s.trace_id == trace_id and s.name == "conveyor.relay"]  # one: the stream's
    assert root.start <= relay.start and relay.end <= root.end + 1e-3  # the request's span covers its stream


def test_a_job_redelivered_after_its_worker_died_shows_both_attempts(traced: tuple[Stack, Spans]) -> None:
    stack, spans = traced
    header, trace_id, _ = _traceparent()
    job = httpx.post(f"{stack.url}/v1/jobs", headers={"traceparent": header},
                     json={"prompt": "Once upon a time", "temperature": 0, "max_tokens": 1500,
                           "ignore_eos": True}).json()
    spans.wait_for(lambda ss: any(s.trace_id == trace_id and s.name == "conveyor.prefill" for s in ss), 30)
    until("tokens", lambda: httpx.get(f"{stack.url}/v1/jobs/{job['id']}").json()["usage"]["completion_tokens"] >= 20,
          30)
    [victim] = stack.worker_pids(names.INFERENCE_POOL)
    os.kill(victim, signal.SIGKILL)  # the supervisor starts another, which takes the job on where it was
    final = until("its end", lambda: (j := httpx.get(f"{stack.url}/v1/jobs/{job['id']}").json())["status"]
                  not in ("queued", "running") and j, 120)
    assert final["status"] == "succeeded" and final["usage"]["completion_tokens"] == 1500
    got = spans.wait_for(lambda ss: sum(s.trace_id == trace_id and s.name == "conveyor.prefill" for s in ss) == 2
                         and any(s.trace_id == trace_id and s.name == "conveyor.decode" for s in ss), 30)
    prefills = sorted((s for s in got if s.trace_id == trace_id and s.name == "conveyor.prefill"),
                      key=lambda s: s.start)
    assert [p.attributes["conveyor.job.resumed"] for p in prefills] == [False, True]
    assert prefills[0].resource["process.pid"] != prefills[1].resource["process.pid"]  # two workers' lanes
    [decode] = [s for s in got if s.trace_id == trace_id and s.name == "conveyor.decode"]  # the first never ended
    assert decode.attributes["conveyor.job.resumed"] is True
    assert decode.attributes["gen_ai.usage.output_tokens"] == 1500
    assert len({s.parent_id for s in got if s.trace_id == trace_id and s.name.startswith("conveyor.")}) == 1


def test_a_batchs_lines_and_a_responses_job_join_their_requests_traces(traced: tuple[Stack, Spans]) -> None:
    stack, spans = traced
    oai = openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)
    model = oai.models.list().data[0].id
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": model, "messages": [{"role": "user", "content": f"Say {i}."}], "max_tokens": 3}}
             for i in range(2)]
    f = oai.files.create(file=("in.jsonl", io.BytesIO(b"".join(json.dumps(x).encode() + b"\n" for x in lines))),
                         purpose="batch")
    header, batch_trace, _ = _traceparent()
    batch = oai.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                               extra_headers={"traceparent": header})
    header, response_trace, _ = _traceparent()
    oai.responses.create(model=model, input="Hi", max_output_tokens=3, extra_headers={"traceparent": header})
    until("the batch's end", lambda: oai.batches.retrieve(batch.id).status == "completed", 120)

    def decodes(trace_id: str, ss: list[Span]) -> list[Span]:
        return [s for s in ss if s.trace_id == trace_id and s.name == "conveyor.decode"]

    got = spans.wait_for(lambda ss: len(decodes(batch_trace, ss)) == 2 and len(decodes(response_trace, ss)) == 1
                         and {"POST /v1/batches", "POST /v1/responses"} <= {s.name for s in ss}, 30)
    [create] = [s for s in got if s.trace_id == batch_trace and s.name == "POST /v1/batches"]
    assert {s.parent_id for s in decodes(batch_trace, got)} == {create.span_id}  # each line's job under the create
    assert len({s.attributes["conveyor.job.id"] for s in decodes(batch_trace, got)}) == 2
    [respond] = [s for s in got if s.trace_id == response_trace and s.name == "POST /v1/responses"]
    assert decodes(response_trace, got)[0].parent_id == respond.span_id


def test_a_request_without_a_traceparent_starts_a_trace_and_an_unsampled_one_is_not_carried(
        traced: tuple[Stack, Spans]) -> None:
    stack, spans = traced
    job = httpx.post(f"{stack.url}/v1/jobs", json={"prompt": "Hello", "max_tokens": 4}).json()
    carrier = stack.redis().hget(names.job_key(job["id"]), "trace")
    assert carrier and carrier.startswith("00-") and int(carrier.split("-")[3], 16) & 1  # sampled
    trace_id = carrier.split("-")[1]
    got = spans.wait_for(lambda ss: {s.name for s in ss if s.trace_id == trace_id} >= {"POST /v1/jobs", *STAGES[:7]},
                         30)  # (each process exports on its own schedule)
    root = next(s for s in got if s.trace_id == trace_id and s.name == "POST /v1/jobs")
    assert root.parent_id == ""  # a new trace, rooted at the API
    for bad in ("garbage", "00-" + "z" * 32 + "-" + "0" * 16 + "-01", "ff-" + "0" * 32 + "-" + "0" * 16 + "-01"):
        job = httpx.post(f"{stack.url}/v1/jobs", json={"prompt": "Hello", "max_tokens": 2},
                         headers={"traceparent": bad})  # not a W3C context: ignored, a trace of its own
        assert job.status_code == 202, job.text
        carrier = stack.redis().hget(names.job_key(job.json()["id"]), "trace")
        assert carrier and carrier.split("-")[1] != "z" * 32
    header, unsampled, _ = _traceparent(sampled=False)
    job = httpx.post(f"{stack.url}/v1/jobs", json={"prompt": "Hello", "max_tokens": 4},
                     headers={"traceparent": header}).json()
    assert stack.redis().hget(names.job_key(job["id"]), "trace") is None  # the client decided: not traced
    until("its end", lambda: httpx.get(f"{stack.url}/v1/jobs/{job['id']}").json()["status"] == "succeeded", 30)
    assert spans.of_trace(unsampled) == []


def test_with_no_endpoint_a_client_traceparent_changes_nothing(tiny_stack: Stack) -> None:
    """The shared stacks run with tracing off: no carrier is kept, so no stage does any tracing work."""
    header, _, _ = _traceparent()
    job = httpx.post(f"{tiny_stack.url}/v1/jobs", json={"prompt": "Hello", "max_tokens": 2},
                     headers={"traceparent": header}).json()
    assert tiny_stack.redis().hget(names.job_key(job["id"]), "trace") is None


def test_with_tracing_off_no_exporter_thread_starts() -> None:
    """`setup` in a process without an endpoint starts no provider and no exporter thread (a fresh interpreter:
    this one's environment may have OpenTelemetry's settings)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    code = ("import threading; from shared import tracing; import api.main; "
            "assert tracing.setup('api') is tracing.enabled() is {}; "
            "print(sorted(t.name for t in threading.enumerate()))")
    out = subprocess.run([sys.executable, "-c", code.format(False)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "Otel" not in out.stdout and out.stdout.strip() == str(sorted(["MainThread"]))
    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = "http://127.0.0.1:9"
    on = subprocess.run([sys.executable, "-c", code.format(True)], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=60)
    assert on.returncode == 0 and "OtelBatch" in on.stdout, (on.stdout, on.stderr)


def test_a_collector_that_never_answers_holds_a_process_that_ends_for_two_seconds_at_most() -> None:
    """A process's last spans at its exit, to a collector that takes the connection and never answers: it waited
    the exporter's timeout (10 s) out of its stop's grace period; it gives up after tracing.SHUTDOWN_S."""
    from shared.tracing import SHUTDOWN_S

    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)  # (accepted by the kernel, never read)
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
               "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{hung.getsockname()[1]}"}
        parent = f"00-{'1' * 32}-{'2' * 16}-01"  # a sampled trace: its span waits in the batch processor
        code = ("import time; from shared import tracing; assert tracing.setup('api'); "
                f"tracing.record('stage', {parent!r}, time.time() - 1, time.time()); "
                "t = time.monotonic(); tracing.shutdown(); print(time.monotonic() - t)")
        started = time.monotonic()
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=60)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.strip().splitlines()[-1]) < SHUTDOWN_S + 1.0, (out.stdout, time.monotonic() - started)
