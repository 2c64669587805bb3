"""The local supervisor scales the tokenizer pool on queue lag and back after the cooldown,
with every job finished (the synthetic engine stands in for the model: this is about the pools)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from infra.redis_server import RedisServer
from shared import names, scripts
from shared.job_ops import submit_write
from shared.jobs import new_record
from tests.conftest import Stack, start_stack, stop_stack
from tests.helpers import until


@pytest.fixture(scope="module")
def scaled(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> Iterator[tuple[Stack, RedisServer]]:
    server = RedisServer(tmp_path_factory.mktemp("redis-scale"))
    server.start()
    stack = start_stack(tmp_path_factory.mktemp("scale"), server.url, model_path, extra={
        "ENGINE": "synthetic", "TOKENIZER_BATCH": "1", "TOKENIZER_LAG_PER_REPLICA": "50", "TOKENIZER_MAX": "3",
        "AUTOSCALE_PERIOD_S": "0.5", "SCALE_IN_COOLDOWN_S": "2", "MAX_NUM_SEQS": "256"}, autoscale=True)
    yield stack, server
    stop_stack(stack)
    server.stop()


def burst(r: redis.Redis, n: int) -> list[str]:
    """Enqueue n jobs at once with the API's own submit script (faster than any HTTP client here)."""
    pipe = r.pipeline(transaction=False)
    ids = []
    for i in range(n):
        job_id = "job_" + uuid.uuid4().hex
        ids.append(job_id)
        request = f'{{"prompt": "Burst job {i}: tell me something.", "max_tokens": 2}}'
        keys, args = submit_write(job_id, new_record(job_id, "m", request), request, 3600)
        scripts.SUBMIT.queue(pipe, keys, args)
    scripts.execute(pipe)
    return ids


def test_burst_scales_tokenizers_out_and_back(scaled: tuple[Stack, RedisServer]) -> None:
    stack, _ = scaled
    r = stack.redis()
    assert len(stack.worker_pids(names.TOKENIZER_POOL)) == 1
    # the pool's tokenizer is paused while the burst waits: the lag holds until the pool grows, however
    # fast this machine tokenizes, and a few hundred jobs are lag enough
    stack.pause("tokenizer")
    try:
        ids = burst(r, 600)
        until("the tokenizer pool to grow", lambda: len(stack.worker_pids(names.TOKENIZER_POOL)) > 1,
              timeout=120, every=0.25)
    finally:
        stack.resume("tokenizer")
    deadline = time.monotonic() + 120
    while True:
        pipe = r.pipeline(transaction=False)
        for j in ids:
            pipe.hget(names.job_key(j), "status")
        statuses = pipe.execute()
        if all(s == "succeeded" for s in statuses) or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert statuses.count("succeeded") == len(ids), {s: statuses.count(s) for s in set(statuses)}
    until("the tokenizer pool to shrink back after the cooldown",
          lambda: len(stack.worker_pids(names.TOKENIZER_POOL)) <= 1, timeout=60, every=0.25)
