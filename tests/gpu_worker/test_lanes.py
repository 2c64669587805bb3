"""The inference worker's lanes: typed messages that pickle, an engine loop driven through its inbox,
the entry ledger's acknowledgements, the control lane's parsing, the output lane's write retry, no
torch with the synthetic engine, and a whole worker (synthetic engine) on a real Redis."""

from __future__ import annotations

import inspect
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from queue import SimpleQueue
from typing import Any

import orjson
import pyarrow as pa
import pytest
import redis

from gpu_worker.control import ControlLane
from gpu_worker.engine import Engine
from gpu_worker.engine.synthetic import WORD_TOKEN, SyntheticEngine
from gpu_worker.engine_loop import EngineLoop
from gpu_worker.ledger import EntryLedger
from gpu_worker.messages import (
    DELTA_SCHEMA,
    Abort,
    Add,
    Deltas,
    Done,
    Ended,
    EngineCommand,
    GraceOver,
    LaneCommand,
    Register,
    Stop,
)
from gpu_worker.output_lane import OutputLane
from gpu_worker.stats import WorkerStats
from infra.redis_server import RedisServer
from shared import names
from shared.jobs import FinishReason, JobStatus, new_record
from shared.schemas import Request, encode_request, from_ipc, to_ipc
from shared.settings import Settings
from tests.conftest import ROOT
from tests.helpers import until


def test_lane_messages_pickle() -> None:
    msgs = [Register("j", ("stop",), 1.5, 3, True, 2, (5, 6), "hi"), Deltas(b"\x00"), Stop(), Done("j"),
            Abort("j", FinishReason.stop), GraceOver(), Add(Request("j", [1, 2]))]
    for msg in msgs:
        assert pickle.loads(pickle.dumps(msg)) == msg


def test_the_synthetic_engine_implements_the_protocol() -> None:
    members = [m for m in vars(Engine) if not m.startswith("_")] + list(Engine.__annotations__)
    for name in members:
        assert hasattr(SyntheticEngine, name), name
        proto = getattr(Engine, name, None)
        if inspect.isfunction(proto):
            assert inspect.signature(getattr(SyntheticEngine, name)) == inspect.signature(proto), name


def test_a_synthetic_worker_imports_no_torch(model_path: str) -> None:
    code = ("import sys\n"
            "from gpu_worker import admission, control, engine_loop, feedback, ledger, messages, output_lane\n"
            "from gpu_worker import reader, stats, worker\n"
            "from shared.settings import Settings\n"
            "engine = worker.build_engine(Settings(engine='synthetic'))\n"
            "assert engine.step() == [] and not engine.has_unfinished()\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "REDIS_URL": "redis://127.0.0.1:1/0", "MODEL": model_path})
    assert out.stdout.split() == ["False", "False"], out.stderr


class Loop:
    """An EngineLoop on the synthetic engine, its sent messages collected."""

    def __init__(self) -> None:
        self.engine = SyntheticEngine(max_num_seqs=4)
        self.inbox: SimpleQueue[EngineCommand] = SimpleQueue()
        self.sent: list[LaneCommand] = []
        self.stopping = threading.Event()
        self.running: set[str] = set()
        self.loop = EngineLoop(self.engine, self.inbox, self.sent.append, WorkerStats(), self.stopping,
                               lambda: not self.running, lambda: True)

    def rows(self) -> list[dict[str, Any]]:
        assert self.loop.sender.drain()  # the sender thread has put every step handed to it
        return [row for msg in self.sent if isinstance(msg, Deltas)
                for row in from_ipc(msg.data, DELTA_SCHEMA).to_pylist()]


def test_engine_loop_adds_steps_aborts_and_drains() -> None:
    t = Loop()
    t.inbox.put(Add(Request("a", [1, 2], max_tokens=3)))
    t.inbox.put(Add(Request("b", [1], max_tokens=1000)))
    t.inbox.put(Abort("late", FinishReason.cancelled))  # its Add comes after the cancel
    assert t.loop.take_commands()
    t.loop.step()
    t.inbox.put(Abort("b", FinishReason.stop))
    t.inbox.put(Add(Request("late", [1], max_tokens=1000)))
    assert t.loop.take_commands()
    while t.engine.has_unfinished():
        t.loop.step()
    ends = {r["job_id"]: r["finish_reason"] for r in t.rows() if r["finish_reason"]}
    assert ends == {"a": "length", "b": "stop", "late": "cancelled"}
    assert [r["token_ids"] for r in t.rows() if r["job_id"] == "a"] == [[WORD_TOKEN]] * 3
    assert t.loop.stats.generated_tokens == 4 and t.loop.stats.steps >= 3
    t.stopping.set()
    assert t.loop.run() is True  # stopping and nothing running: drained


def test_engine_loop_grace_over_ends_a_drain_early() -> None:
    t = Loop()
    t.inbox.put(Add(Request("a", [1], max_tokens=10**9)))
    t.running.add("a")
    t.stopping.set()

    def grace_over_once_stepping() -> None:
        until("the engine loop to step", lambda: t.loop.stats.steps > 0)
        t.inbox.put(GraceOver())

    threading.Thread(target=grace_over_once_stepping, daemon=True).start()
    assert t.loop.run() is False
    assert t.engine.has_unfinished()  # ended by the grace, not drained


def test_engine_loop_fails_a_request_the_engine_refuses() -> None:
    class Refusing(SyntheticEngine):
        def add_request(self, req: Request) -> None:
            raise RuntimeError("no room")

    t = Loop()
    t.loop.engine = Refusing()
    t.inbox.put(Add(Request("x", [1])))
    assert t.loop.take_commands()
    [row] = t.rows()
    assert row["finish_reason"] == "error" and "no room" in row["error"]


class FakeConsumer:
    cluster = False  # (one Redis: acknowledged in one call, retried through an outage)

    def __init__(self, fail: int = 0) -> None:
        self.acked: list[str] = []
        self.fail = fail

    def ack(self, ids: list[str]) -> None:
        if self.fail:
            self.fail -= 1
            raise redis.ConnectionError("down")
        self.acked += ids

    def note_outage(self) -> None:
        pass  # StreamConsumer's: a cluster client rebuilds its slot map (none here)


def test_ledger_acks_a_jobs_entry_when_the_job_ends() -> None:
    consumer = FakeConsumer(fail=2)  # the ack is retried through an outage
    ledger = EntryLedger(consumer, max_jobs=2, spare=1)  # type: ignore[arg-type]
    ledger.open("e1", "j1")
    ledger.open("e2", "j2")
    ledger.take_slot("j1", "heavy", priority=1000)
    ledger.take_slot("j2", "heavy", priority=0)
    assert not ledger.has_room(0.01) and ledger.entries() == ["e1", "e2"]
    # full: only a tenant with nothing here, or a job better than the worst of its tenant here, may still come
    # in, into the spare room
    assert ledger.free() == 0 and ledger.spare() == 1 and ledger.worst_priorities() == {"heavy": 1000}
    ledger.close("j1")
    assert consumer.acked == ["e1"] and ledger.has_room(0.01) and not ledger.idle()
    assert ledger.worst_priorities() == {"heavy": 0} and ledger.entries() == ["e2"]
    ledger.close("j1")  # a second report of the same end changes nothing
    assert ledger.free() == 1 and consumer.acked == ["e1"]
    ledger.close("j2")
    assert consumer.acked == ["e1", "e2"] and ledger.idle() and ledger.entries() == []
    assert ledger.worst_priorities() == {}


def test_control_lane_turns_cancels_into_aborts() -> None:
    inbox: SimpleQueue[EngineCommand] = SimpleQueue()
    lane = ControlLane(None, inbox, threading.Event())  # type: ignore[arg-type]
    for data in (b"{not json", b"[1]", b'{"op": "cancel"}', b'{"op": "other", "job_id": "a"}',
                 orjson.dumps({"op": "cancel", "job_id": "job_1"})):
        lane.handle(data)
    assert inbox.get_nowait() == Abort("job_1", FinishReason.cancelled) and inbox.empty()


def test_output_lane_replays_a_step_write_after_an_outage(redis_url: str, model_path: str) -> None:
    settings = Settings(redis_url=redis_url, model=model_path)
    feedback: SimpleQueue[Any] = SimpleQueue()
    lane = OutputLane(settings, feedback)  # type: ignore[arg-type]
    r = redis.Redis.from_url(redis_url)
    job_id = f"job_replay_{time.time_ns()}"
    r.hset(names.job_key(job_id), mapping=new_record(job_id, "m", "{}") | {"status": "running"})
    lane.register(Register(job_id, (), time.time(), 1, started=True))
    rows = [{"job_id": job_id, "token_ids": [WORD_TOKEN, WORD_TOKEN], "finish_reason": "length", "error": None}]
    pipe, done = lane.build(to_ipc(pa.RecordBatch.from_pylist(rows, schema=DELTA_SCHEMA)))

    def drop(**kwargs: Any) -> Any:  # as a lost connection does: the pipeline is emptied
        pipe.reset()
        raise redis.ConnectionError("lost")

    pipe.execute = drop
    lane.commit(pipe, done)
    assert [feedback.get_nowait(), feedback.get_nowait()] == [Ended(job_id), Done(job_id)]
    assert r.hget(names.job_key(job_id), "status") == JobStatus.succeeded.value.encode()
    assert r.hget(names.job_key(job_id), "completion_tokens") == b"2"


# --- a whole worker, synthetic engine, real Redis --------------------------------------------------


CLAIM_IDLE_MS = 3000
DRAIN_GRACE_S = 1


@pytest.fixture
def worker_env(tmp_path: Path, redis_server: RedisServer, model_path: str) -> dict[str, str]:
    """A whole worker's environment: db 10 of the session's Redis (emptied first), the synthetic engine, fast
    redelivery and a short drain, its cache in the test's directory."""
    url = redis_server.url.rsplit("/", 1)[0] + "/10"
    redis.Redis.from_url(url).flushdb()
    return dict(os.environ) | {"REDIS_URL": url, "MODEL": model_path, "ENGINE": "synthetic",
                               "CLAIM_IDLE_MS": str(CLAIM_IDLE_MS), "REFRESH_S": "0.5", "HEARTBEAT_S": "1",
                               "DRAIN_GRACE_S": str(DRAIN_GRACE_S), "LOG_LEVEL": "INFO",
                               "CONVEYOR_CACHE": str(tmp_path)}


def enqueue(r: redis.Redis, jobs: dict[str, int]) -> None:
    """A `tokenized` entry per job (id -> max_tokens), as the fair queue hands them out."""
    for job_id, max_tokens in jobs.items():
        r.hset(names.job_key(job_id), mapping=new_record(job_id, "m", "{}"))
        record = encode_request(Request(job_id, [1, 2, 3], max_tokens=max_tokens, temperature=0.0, seed=1,
                                        ignore_eos=True))
        r.xadd(names.stream(names.TOKENIZED, 0), {"batch": record, "jobs": 1})


def status_of(r: redis.Redis, job_id: str, want: set[str], timeout: float = 60) -> dict[bytes, bytes]:
    def record() -> dict[bytes, bytes] | None:
        rec = r.hgetall(names.job_key(job_id))
        return rec if rec.get(b"status", b"").decode() in want else None

    return until(f"{job_id} to be {' or '.join(sorted(want))}", record, timeout)


def test_a_synthetic_worker_runs_cancels_acks_and_drains(worker_env: dict[str, str], tmp_path: Path) -> None:
    r = redis.Redis.from_url(worker_env["REDIS_URL"])
    log = open(tmp_path / "worker.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "infra.cli", "inference"], env=worker_env, cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        enqueue(r, {"job_short_a": 5, "job_short_b": 7})
        for job_id, n in (("job_short_a", b"5"), ("job_short_b", b"7")):
            rec = status_of(r, job_id, {"succeeded", "failed"})
            assert rec[b"status"] == b"succeeded" and rec[b"completion_tokens"] == n, rec
        until("the entry to be acknowledged once both its jobs ended",
              lambda: not r.xpending(names.stream(names.TOKENIZED, 0), names.INFERENCE_GROUP)["pending"], 10)

        enqueue(r, {"job_long": 10**9})
        status_of(r, "job_long", {"running"})
        r.hset(names.job_key("job_long"), "cancel_requested", "1")
        r.publish(names.CONTROL_CHANNEL, orjson.dumps({"op": "cancel", "job_id": "job_long"}))
        rec = status_of(r, "job_long", {"cancelled", "succeeded", "failed"})
        assert rec[b"status"] == b"cancelled" and rec[b"finish_reason"] == b"cancelled", rec

        enqueue(r, {"job_drained": 10**9})
        status_of(r, "job_drained", {"running"})
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        elapsed = time.monotonic() - t0
        assert elapsed < DRAIN_GRACE_S + 10 + 5  # the grace, the hand-back, the lane's stop
        # handed back at the grace's end: claimable by another worker now, not CLAIM_IDLE_MS after the
        # worker stopped refreshing it (an entry not handed back would be idle only about `elapsed`)
        [pending] = r.xpending_range(names.stream(names.TOKENIZED, 0), names.INFERENCE_GROUP, "-", "+", 10)
        assert pending["time_since_delivered"] >= CLAIM_IDLE_MS + 1000 * (elapsed - DRAIN_GRACE_S)
        assert r.hget(names.job_key("job_drained"), "status") == b"running"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


@pytest.mark.slow
def test_a_killed_synthetic_workers_job_resumes_on_another(worker_env: dict[str, str], tmp_path: Path) -> None:
    r = redis.Redis.from_url(worker_env["REDIS_URL"])
    log = open(tmp_path / "worker.log", "ab")
    spawn = lambda: subprocess.Popen([sys.executable, "-m", "infra.cli", "inference"],  # noqa: E731
                                     env=worker_env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    total = 6000
    first, second = spawn(), None
    try:
        enqueue(r, {"job_resumed": total})
        status_of(r, "job_resumed", {"running"})
        until("500 tokens recorded by the first worker",
              lambda: int(r.hget(names.job_key("job_resumed"), "completion_tokens") or 0) >= 500, 60)
        first.kill()
        first.wait()
        assert r.hget(names.job_key("job_resumed"), "status") == b"running"
        assert int(r.hget(names.job_key("job_resumed"), "completion_tokens") or 0) < total
        second = spawn()
        rec = status_of(r, "job_resumed", {"succeeded", "failed"}, timeout=120)
        assert rec[b"status"] == b"succeeded" and rec[b"completion_tokens"] == str(total).encode(), rec
        tokens = [(eid, f[b"text"]) for eid, f in r.xrange(names.events_key("job_resumed")) if f[b"type"] == b"token"]
        assert [int(eid.split(b"-")[1]) for eid, _ in tokens] == list(range(1, len(tokens) + 1))  # none lost or twice
        text = b"".join(t for _, t in tokens)
        assert text == r.get(names.text_key("job_resumed")) and text.count(b" further") == total
        assert r.xpending(names.stream(names.TOKENIZED, 0), names.INFERENCE_GROUP)["pending"] == 0
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        log.close()
