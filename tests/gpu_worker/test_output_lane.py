"""The output lane on a real Redis with the real tokenizer: what a job's stream and record hold
after each engine step, with every token streamed and with STREAM_INTERVAL > 1."""

from __future__ import annotations

import queue

import pyarrow as pa
import pytest
import redis
from tokenizers import Tokenizer

from gpu_worker.messages import Abort, LaneReport, Register
from gpu_worker.output_lane import OutputLane
from shared import names
from shared.job_ops import unpack_ids
from shared.jobs import FinishReason, JobStatus, new_record
from shared.schemas import DELTA_SCHEMA, to_ipc
from shared.settings import Settings

TEXT = "The capital of France is Paris. It is known for the Eiffel Tower and fine food."


class Lane:
    """One OutputLane and one running job, fed token ids a step at a time."""

    def __init__(self, redis_url: str, model_path: str, interval: int, job_id: str, stop: list[str]) -> None:
        settings = Settings(redis_url=redis_url, model=model_path, stream_interval=interval)
        self.feedback: queue.SimpleQueue[LaneReport] = queue.SimpleQueue()
        self.lane = OutputLane(settings, self.feedback)  # type: ignore[arg-type]
        self.r = redis.Redis.from_url(redis_url, decode_responses=False)
        self.job_id = job_id
        record = new_record(job_id, "m", "{}") | {"status": JobStatus.running.value}
        self.r.hset(names.job_key(job_id), mapping=record)
        self.lane.register(Register(job_id, tuple(stop), float(record["created_at"]), prompt_tokens=3, started=True))

    def step(self, ids: list[int], reason: str | None = None) -> None:
        row = {"job_id": self.job_id, "token_ids": ids, "finish_reason": reason, "error": None}
        self.lane.handle_deltas(to_ipc(pa.RecordBatch.from_pylist([row], schema=DELTA_SCHEMA)))

    def token_events(self) -> list[str]:
        items = self.r.xrange(names.events_key(self.job_id))
        return [f[b"text"].decode() for _, f in items if f[b"type"] == b"token"]

    def saved(self) -> tuple[list[int], str, int]:
        """What a worker resuming this job would read: saved ids, saved text, completion_tokens."""
        ids = unpack_ids(self.r.get(names.tokens_key(self.job_id)))
        text = (self.r.get(names.text_key(self.job_id)) or b"").decode()
        return ids, text, int(self.r.hget(names.job_key(self.job_id), "completion_tokens") or 0)

    def status(self) -> str:
        return self.r.hget(names.job_key(self.job_id), "status").decode()  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def tokenizer(model_path: str) -> Tokenizer:
    return Tokenizer.from_file(f"{model_path}/tokenizer.json")


@pytest.mark.parametrize("interval", [1, 4])
def test_stream_and_record_per_interval(redis_url: str, model_path: str, tokenizer: Tokenizer,
                                        interval: int) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    lane = Lane(redis_url, model_path, interval, f"job_lane_interval_{interval}", [])
    lane.step(ids[:1])
    assert lane.token_events() == [tokenizer.decode(ids[:1])]  # the first token goes out at once
    for n in range(2, len(ids)):
        lane.step(ids[n - 1:n])
        saved_ids, saved_text, completion = lane.saved()
        # Written every `interval` tokens; ids, text and count always agree (what a resumed job reads).
        assert len(saved_ids) == 1 + (n - 1) // interval * interval
        assert saved_ids == ids[:len(saved_ids)] and completion == len(saved_ids)
        assert saved_text == tokenizer.decode(saved_ids)
        assert "".join(lane.token_events()) == saved_text
    lane.step(ids[-1:], "length")
    events = lane.token_events()
    assert "".join(events) == TEXT
    assert len(events) == 1 + -(-(len(ids) - 1) // interval)  # the first, then one per interval (ceil)
    assert lane.saved() == (ids, TEXT, len(ids))
    assert lane.status() == JobStatus.succeeded.value


def test_stop_string_is_caught_at_its_step_when_tokens_are_held(redis_url: str, model_path: str,
                                                               tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    lane = Lane(redis_url, model_path, 8, "job_lane_stop", ["Eiffel"])
    prefix = next(n for n in range(len(ids)) if "Eiffel" in tokenizer.decode(ids[:n]))
    for n in range(1, prefix + 1):
        lane.step(ids[n - 1:n])
        if n < prefix:
            assert lane.feedback.empty()
    assert lane.feedback.get_nowait() == Abort("job_lane_stop", FinishReason.stop)  # at the step that completed it
    assert "".join(lane.token_events()) == TEXT[:TEXT.index("Eiffel")]
    assert lane.status() == JobStatus.succeeded.value
