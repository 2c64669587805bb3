"""A batch survives kill -9 of the Celery worker driving it, of the API that made it and of the inference worker
running its lines: the supervisor restarts them, a driver takes the batch's lease over, and every line's result
is recorded exactly once. The stack is its own: the runs go on in turn, in one worker (the module's group)."""

from __future__ import annotations

import io
import json
import os
import signal
from collections.abc import Iterator

import openai
import pytest

from tests.conftest import Stack, start_stack, stop_stack
from tests.helpers import until

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("batch_stack")]  # its tests share the module's `bstack`
LINES = 40
VICTIMS = ("celery", "api", "inference")


@pytest.fixture(scope="module")
def bstack(tmp_path_factory: pytest.TempPathFactory, redis_url: str, tiny_model_dir: str) -> Iterator[Stack]:
    """The stack a batch runs on through a kill -9 of each victim in turn (db 12 of the session's Redis)."""
    url = redis_url.rsplit("/", 1)[0] + "/12"
    s = start_stack(tmp_path_factory.mktemp("batch-stack"), url, tiny_model_dir, extra={"CLAIM_IDLE_MS": "2000"})
    try:
        yield s
    finally:
        stop_stack(s)


@pytest.mark.parametrize("victim", VICTIMS)
def test_a_batch_completes_through_a_kill_9(bstack: Stack, victim: str) -> None:
    oai = openai.OpenAI(base_url=bstack.url + "/v1", api_key="unused", max_retries=5)
    model = oai.models.list().data[0].id
    lines = [{"custom_id": f"{victim}-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": f"Line {i}", "max_tokens": 48, "ignore_eos": True}}
             for i in range(LINES)]
    f = oai.files.create(file=("in.jsonl", io.BytesIO("".join(json.dumps(x) + "\n" for x in lines).encode())),
                         purpose="batch")
    batch = oai.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    until("a few lines done", lambda: oai.batches.retrieve(batch.id).request_counts.completed >= 2, timeout=120,
          every=0.1)
    [proc] = bstack.by_role(victim)[:1]
    os.kill(proc.pid, signal.SIGKILL)
    until("the batch completes", lambda: _status(oai, batch.id) == "completed", timeout=240, every=0.5)
    done = oai.batches.retrieve(batch.id)
    assert (done.request_counts.completed, done.request_counts.failed) == (LINES, 0)
    out = [json.loads(x) for x in oai.files.content(done.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(x["custom_id"] for x in lines)  # each exactly once


def _status(oai: openai.OpenAI, batch_id: str) -> str | None:
    try:
        return oai.batches.retrieve(batch_id).status
    except (openai.APIConnectionError, openai.InternalServerError):
        return None  # the API is restarting
