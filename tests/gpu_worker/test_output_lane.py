"""The output lane on a real Redis with the real tokenizer: what a job's stream and record hold
after each engine step, with every token streamed and with STREAM_INTERVAL > 1; a job whose record is
gone, or that another worker took over, is dropped with nothing written."""

from __future__ import annotations

import queue

import pyarrow as pa
import pytest
import redis
from tokenizers import Tokenizer

from gpu_worker import output_lane
from gpu_worker.messages import DELTA_SCHEMA, Abort, Done, Dropped, Ended, LaneReport, Register
from gpu_worker.output_lane import OutputLane
from shared import names
from shared.job_ops import JobOps, unpack_ids
from shared.jobs import FinishReason, Job, JobStatus, new_record
from shared.schemas import to_ipc
from shared.settings import Settings

TEXT = "The capital of France is Paris. It is known for the Eiffel Tower and fine food."


class Lane:
    """One OutputLane and one running job, fed token ids a step at a time."""

    def __init__(self, redis_url: str, model_path: str, interval: int, job_id: str, stop: list[str],
                 worker: str = "") -> None:
        settings = Settings(redis_url=redis_url, model=model_path, stream_interval=interval)
        self.feedback: queue.SimpleQueue[LaneReport] = queue.SimpleQueue()
        self.lane = OutputLane(settings, self.feedback)  # type: ignore[arg-type]
        self.r = redis.Redis.from_url(redis_url, decode_responses=False)
        self.job_id = job_id
        record = new_record(job_id, "m", "{}") | {"status": JobStatus.running.value, "worker": worker}
        self.r.hset(names.job_key(job_id), mapping=record)
        self.lane.register(Register(job_id, tuple(stop), float(record["created_at"]), prompt_tokens=3, started=True,
                                    worker=worker))

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

    def reports(self) -> list[LaneReport]:
        out = []
        while not self.feedback.empty():
            out.append(self.feedback.get_nowait())
        return out

    def keys(self) -> list[str]:
        j = self.job_id
        return [names.job_key(j), names.events_key(j), names.tokens_key(j), names.text_key(j), names.logprobs_key(j)]

    def everything(self) -> list[object]:
        """Every key of the job, dumped: what a write would change."""
        return [self.r.dump(k) for k in self.keys()]


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
    lane = Lane(redis_url, model_path, 8, "job_lane_stop", ["never written", "Eiffel"])
    prefix = next(n for n in range(len(ids)) if "Eiffel" in tokenizer.decode(ids[:n]))
    for n in range(1, prefix + 1):
        lane.step(ids[n - 1:n])
        if n < prefix:
            assert lane.feedback.empty()
    assert lane.feedback.get_nowait() == Abort("job_lane_stop", FinishReason.stop)  # at the step that completed it
    assert "".join(lane.token_events()) == TEXT[:TEXT.index("Eiffel")]
    assert lane.status() == JobStatus.succeeded.value
    # the record names the stop string that ended it (Anthropic's `stop_sequence`, vLLM's `stop_reason`)
    job = Job.from_record({k.decode(): v.decode() for k, v in lane.r.hgetall(names.job_key(lane.job_id)).items()})
    assert job.stop_sequence == "Eiffel" and job.finish_reason is FinishReason.stop


def test_a_job_another_worker_took_over_is_aborted_and_forgotten(redis_url: str, model_path: str,
                                                                 tokenizer: Tokenizer) -> None:
    """This worker was cut off past the claim deadline and another took its job over: the lane's next step
    (the one it retried through the outage) writes nothing, the engine aborts the job and the ledger lets it
    go without acknowledging the entry the other worker holds now (Dropped, never Done)."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    lane = Lane(redis_url, model_path, 1, "job_lane_taken", [], worker="w1")
    lane.step(ids[:1])
    assert JobOps(lane.r, 60).start(lane.job_id, "w2").code.name == "resumed"
    before = lane.everything()
    lane.step(ids[1:2])
    assert lane.reports() == [Abort(lane.job_id, FinishReason.error), Dropped(lane.job_id)]
    assert lane.job_id not in lane.lane.states
    lane.step(ids[2:3], "error")  # the engine's output before the abort reached it, then its end: ignored
    assert lane.reports() == [] and lane.everything() == before and lane.status() == JobStatus.running.value


def test_a_job_ending_in_the_step_that_finds_it_taken_is_dropped_not_done(redis_url: str, model_path: str,
                                                                          tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    lane = Lane(redis_url, model_path, 1, "job_lane_taken_end", [], worker="w1")
    lane.step(ids[:1])
    JobOps(lane.r, 60).start(lane.job_id, "w2")
    before = lane.everything()
    lane.step(ids[1:2], "length")
    assert lane.reports() == [Ended(lane.job_id), Dropped(lane.job_id)]  # the engine has ended it: nothing to abort
    assert lane.everything() == before and lane.job_id not in lane.lane.states


def test_a_job_whose_record_is_gone_is_aborted_and_forgotten(redis_url: str, model_path: str,
                                                             tokenizer: Tokenizer) -> None:
    """A failover lost the job's record (the replica never had it): no step or finish brings back a half
    record."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    lane = Lane(redis_url, model_path, 1, "job_lane_gone", [], worker="w1")
    lane.step(ids[:1])
    lane.r.delete(*lane.keys())
    lane.step(ids[1:2])
    assert lane.reports() == [Abort(lane.job_id, FinishReason.error), Dropped(lane.job_id)]
    lane.step(ids[2:3], "length")
    assert lane.reports() == [] and lane.r.exists(*lane.keys()) == 0


def test_a_job_whose_record_was_damaged_is_dropped_and_the_lane_goes_on(redis_url: str, model_path: str,
                                                                         tokenizer: Tokenizer) -> None:
    """A job's record overwritten by hand with a key of another type: its step is a gap, its failure finds no job
    to end, and it is dropped; the lane goes on (its finish raised WRONGTYPE, and the output lane died)."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    lane = Lane(redis_url, model_path, 1, "job_lane_damaged", [], worker="w1")
    lane.step(ids[:1])
    lane.r.delete(names.job_key(lane.job_id))
    lane.r.set(names.job_key(lane.job_id), "damaged")
    lane.step(ids[1:2])
    assert lane.reports() == [Abort(lane.job_id, FinishReason.error), Dropped(lane.job_id)]
    assert lane.r.get(names.job_key(lane.job_id)) == b"damaged"  # nothing written into it
    record = new_record("job_lane_beside_damaged", "m", "{}") | {"status": JobStatus.running.value, "worker": "w1"}
    lane.r.hset(names.job_key(record["id"]), mapping=record)  # another job, on the same lane
    lane.lane.register(Register(record["id"], (), float(record["created_at"]), prompt_tokens=3, started=True,
                                worker="w1"))
    lane.job_id = record["id"]
    lane.step(ids[:2])
    lane.step(ids[2:3], "length")
    assert lane.reports() == [Ended(lane.job_id), Done(lane.job_id)] and lane.status() == JobStatus.succeeded.value


def test_a_job_the_lane_still_owns_ends_done(redis_url: str, model_path: str, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    lane = Lane(redis_url, model_path, 1, "job_lane_owned", [], worker="w1")
    lane.step(ids[:2])
    lane.step(ids[2:3], "length")
    assert lane.reports() == [Ended(lane.job_id), Done(lane.job_id)] and lane.status() == JobStatus.succeeded.value


def test_a_finish_named_for_another_owner_is_sent_again_for_the_records(redis_url: str, model_path: str,
                                                                         tokenizer: Tokenizer) -> None:
    """The step's finish names the owner the lane was told at the job's start; a record that names another writes
    nothing (owner_changed: its keys are the other tenant's). The lane ends the job again, for the record's owner,
    before it reports Done: never Done (and the entry acknowledged) for a job still running."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    lane = Lane(redis_url, model_path, 1, "job_lane_owner_changed", [], worker="w1")
    lane.step(ids[:2])
    lane.r.hset(names.job_key(lane.job_id), "owner", "another-tenant")
    lane.step(ids[2:3], "length")
    assert lane.reports() == [Ended(lane.job_id), Done(lane.job_id)] and lane.status() == JobStatus.succeeded.value


def _roll_back(lane: Lane, replica: list[object]) -> None:
    """The job's keys as a replica had them: a failover promoted it before it copied the steps since."""
    for key, dump in zip(lane.keys(), replica):
        lane.r.delete(key)
        if dump is not None:
            lane.r.restore(key, 0, dump)


@pytest.mark.parametrize("last", ["an id, no text", "text, its end", "text, mid-run"])
def test_a_job_whose_record_lost_steps_has_them_written_again(redis_url: str, model_path: str, tokenizer: Tokenizer,
                                                              last: str) -> None:
    """A failover promoted a replica that never had the job's last steps (only ends wait for a replica): the
    lane's next step would leave a hole (SETRANGE past the end pads with NUL bytes), or its finish finds the record
    short of what the lane wrote. The lane writes the lost steps again, in order, then its step: the job goes on
    (or ends) as if nothing was lost; its record and its event stream hold every chunk once, in order."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    lane = Lane(redis_url, model_path, 1, f"job_lane_rolled_back_{last.replace(' ', '_')}", [], worker="w1")
    lane.step(ids[:1])
    replica = lane.everything()  # what the replica had
    lane.step(ids[1:2])
    lane.step(ids[2:3])
    _roll_back(lane, replica)
    if last == "an id, no text":
        sent = ids[:3] + [tokenizer.token_to_id("<|im_end|>")]
        lane.step(sent[3:], "stop")
    elif last == "text, its end":
        sent = ids[:4]
        lane.step(ids[3:4], "length")
    else:
        lane.step(ids[3:4])
        assert lane.reports() == []  # not stopped, not dropped
        sent = ids[:5]
        lane.step(ids[4:5], "length")
    assert lane.reports() == [Ended(lane.job_id), Done(lane.job_id)]
    assert lane.status() == JobStatus.succeeded.value
    text = tokenizer.decode(sent, skip_special_tokens=True)  # (the end of turn adds no text)
    assert lane.saved() == (sent, text, len(sent))
    assert "".join(lane.token_events()) == text
    seqs = [int(entry_id.split(b"-")[1]) for entry_id, _ in lane.r.xrange(names.events_key(lane.job_id))]
    assert seqs == list(range(1, len(seqs) + 1))  # each chunk once, in order, and the done event after them
    assert lane.job_id not in lane.lane.states


def test_a_job_whose_record_lost_more_than_the_lane_keeps_fails_rather_than_ending_short(
        redis_url: str, model_path: str, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the record lost more steps than the lane keeps (`HISTORY_WRITES`), the job ends as an error that says
    so, never as a success with a part missing; the engine stops it and the lane forgets it."""
    monkeypatch.setattr(output_lane, "HISTORY_WRITES", 1)
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    lane = Lane(redis_url, model_path, 1, "job_lane_rolled_back_too_far", [], worker="w1")
    lane.step(ids[:1])
    replica = lane.everything()
    lane.step(ids[1:2])
    _roll_back(lane, replica)
    lane.step(ids[2:3])
    assert lane.reports() == [Abort(lane.job_id, FinishReason.error), Done(lane.job_id)]
    lane.step(ids[3:4], "length")  # the engine's output before the abort reached it: ignored
    assert lane.reports() == []
    assert lane.status() == JobStatus.failed.value
    assert b"not recorded" in lane.r.hget(names.job_key(lane.job_id), "error")  # type: ignore[operator]
    assert b"\x00" not in (lane.r.get(names.text_key(lane.job_id)) or b"")
    assert lane.job_id not in lane.lane.states
