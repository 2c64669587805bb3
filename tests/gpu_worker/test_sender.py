"""The engine loop's sender: a step's outputs are encoded and put on the output lane's queue off the busy
loop, in order, through a bounded hand-off; a lane that died ends the worker, as it does without one."""

from __future__ import annotations

import threading

import pytest

from gpu_worker.engine.step import StepOutput
from gpu_worker.engine_loop import LANE_DIED, Sender
from gpu_worker.messages import Deltas, LaneCommand
from shared.jobs import FinishReason


def _rows(sent: list[LaneCommand]) -> list[tuple[str, list[int], str | None]]:
    return [(r["job_id"], r["token_ids"], r["finish_reason"]) for msg in sent if isinstance(msg, Deltas)
            for r in msg.rows()]


def test_steps_go_out_in_order_while_the_lane_is_slow() -> None:
    gate = threading.Event()
    sent: list[LaneCommand] = []

    def slow_lane(cmd: LaneCommand) -> None:
        gate.wait(60)
        sent.append(cmd)

    sender = Sender(slow_lane, ahead_max=4)
    for i in range(4):  # the lane takes nothing yet: the loop hands over its steps and goes on
        sender.put([StepOutput(f"j{i % 2}", [i])])
    assert not sender.drain(0.05) and sent == []
    gate.set()
    sender.put([StepOutput("j0", [4], FinishReason.length)])  # waited for room, then handed over
    assert sender.drain()
    assert _rows(sent) == [("j0", [0], None), ("j1", [1], None), ("j0", [2], None), ("j1", [3], None),
                           ("j0", [4], "length")]


def test_a_full_hand_off_waits_for_the_lane() -> None:
    taken = threading.Semaphore(0)
    sent: list[LaneCommand] = []

    def lane(cmd: LaneCommand) -> None:
        taken.acquire()
        sent.append(cmd)

    sender = Sender(lane, ahead_max=2)
    sender.put([StepOutput("a", [1])])
    sender.put([StepOutput("a", [2])])
    third = threading.Thread(target=sender.put, args=([StepOutput("a", [3])],))
    third.start()
    third.join(0.2)
    assert third.is_alive()  # backpressure: the hand-off is full until the lane takes one
    taken.release()
    third.join(60)
    assert not third.is_alive()
    for _ in range(2):
        taken.release()
    assert sender.drain() and [r[1] for r in _rows(sent)] == [[1], [2], [3]]


def test_a_dead_lane_ends_the_worker() -> None:
    def dead_lane(cmd: LaneCommand) -> None:
        raise SystemExit(LANE_DIED)  # what the worker's send does once the lane process is gone

    sender = Sender(dead_lane)
    sender.put([StepOutput("a", [1])])
    assert not sender.drain()
    assert isinstance(sender.failed, SystemExit)
    with pytest.raises(SystemExit, match="output lane died"):
        sender.put([StepOutput("a", [2])])
