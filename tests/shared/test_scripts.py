"""The Redis protocol's scripts: one documented file each, called by SHA with a NOSCRIPT fallback
(pipelines included, never SCRIPT EXISTS), and a step that tolerates being replayed."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from infra.redis_server import RedisServer
from shared import names, scripts
from shared.job_ops import FIRST_TOKEN, FRESH, JobOps, step_write
from shared.jobs import FinishReason, new_record
from shared.redis_client import sync_client
from shared.scripts.codes import StartCode
from tests.conftest import own_redis


@pytest.fixture
def raw(redis_server) -> Iterator[redis.Redis]:  # type: ignore[no-untyped-def]
    """A client of ours (its pipelines replay NOSCRIPT), on a flushed database, not decoding (as the workers)."""
    client = sync_client(redis_server.url.rsplit("/", 1)[0] + "/13", decode=False)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


def test_every_script_is_a_documented_file() -> None:
    files = {p.stem for p in scripts.HERE.glob("*.lua")}
    assert files == {s.name for s in scripts.ALL}
    for script in scripts.ALL:
        header = "\n".join(line for line in script.source.splitlines() if line.startswith("--"))
        assert re.search(r"^-- KEYS", header, re.M), script.name
        assert re.search(r"^-- ARGV", header, re.M) or "ARGV" not in script.source.replace(header, ""), script.name
        assert "Returns" in header, script.name


def test_scripts_ship_with_the_package() -> None:
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert '"shared.scripts" = ["*.lua"]' in pyproject


def test_a_call_loads_the_script_when_redis_lost_it(raw: redis.Redis) -> None:
    raw.script_flush()
    assert scripts.TAIL(raw, [names.stream(names.JOBS, 0)], [5]) == [b"0-0"]


def _commands(client: redis.Redis) -> dict[str, int]:
    return {k: int(v["calls"]) for k, v in client.info("commandstats").items()}


@pytest.fixture(scope="module")
def quiet_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server of its own: its command counts are this module's alone (the session's serves live stacks)."""
    yield from own_redis(tmp_path_factory, "quiet-redis")


def test_a_pipeline_replays_what_answered_noscript_in_order(quiet_server: RedisServer) -> None:
    raw = sync_client(quiet_server.url, decode=False)
    plain = redis.Redis.from_url(quiet_server.url)
    for transaction in (True, False):
        raw.flushdb()
        raw.script_flush()
        raw.config_resetstat()
        pipe = plain.pipeline(transaction=transaction)  # any client's pipeline, through scripts.execute
        pipe.set("before", 1)
        scripts.TAIL.queue(pipe, [names.stream(names.JOBS, 0)], [5])
        pipe.incr("before")
        assert scripts.execute(pipe) == [True, [b"0-0"], 2]
        stats = _commands(raw)
        assert stats["cmdstat_evalsha"] == 2 and stats.get("cmdstat_eval", 0) == 0
        assert stats["cmdstat_script"] == len(scripts.ALL)  # the loads, and no SCRIPT EXISTS
    plain.close()
    raw.close()


def test_our_clients_pipelines_replay_noscript_on_their_own(raw: redis.Redis) -> None:
    raw.script_flush()
    pipe = raw.pipeline(transaction=True)
    scripts.TAIL.queue(pipe, [names.stream(names.ENDED, 0)], [1])
    assert pipe.execute() == [[b"0-0"]]


def _running_job(r: redis.Redis, job_id: str) -> None:
    r.hset(names.job_key(job_id), mapping=new_record(job_id, "m", "{}"))
    assert JobOps(r, 60).start(job_id, "w").code is StartCode.started


def test_a_replayed_step_is_reported_not_raised(raw: redis.Redis) -> None:
    ops = JobOps(raw, 60)
    _running_job(raw, "j1")
    keys, args = step_write("j1", FRESH | FIRST_TOKEN, 0, b"\x01\x00\x00\x00", 0, b"Hi", 1, b'{"seq":1}', 1)
    for expected in ([1, 0], [0, 1]):  # the second is the same step again, as after a reconnect
        raw.script_flush()
        pipe = raw.pipeline(transaction=True)
        ops.step(keys, args, pipe)
        ops.finish("j1", FinishReason.stop, fields={"completion_tokens": 1}, pipe=pipe)
        assert pipe.execute(raise_on_error=False) == [expected, 2 if expected == [1, 0] else 0]
    assert [e for e, _ in raw.xrange(names.events_key("j1"))] == [b"0-1", b"0-2"]
    assert raw.hget(names.job_key("j1"), "seq") == b"2"  # the replay did not wind it back
    assert raw.get(names.text_key("j1")) == b"Hi"
    assert ops.resume_state("j1") == (b"\x01\x00\x00\x00", "Hi", 2, 0)
    assert 0 < raw.ttl(names.tokens_key("j1")) <= 60


def test_step_flags_fresh_and_first_token(raw: redis.Redis) -> None:
    ops = JobOps(raw, 60)
    _running_job(raw, "j2")
    pipe = raw.pipeline(transaction=True)
    keys, args = step_write("j2", FRESH, 0, b"", 0, b"", 0, b"", 0)
    ops.step(keys, args, pipe)
    pipe.execute()
    assert raw.hget(names.job_key("j2"), "first_token_at") is None
    keys, args = step_write("j2", FIRST_TOKEN, 0, b"\x02\x00\x00\x00", 0, b"", 0, b"", 1)
    ops.step(keys, args, pipe)
    pipe.execute()
    assert raw.hget(names.job_key("j2"), "first_token_at") is not None
    assert raw.hget(names.job_key("j2"), "completion_tokens") == b"1"
