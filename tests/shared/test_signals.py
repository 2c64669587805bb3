"""group_lag against the real redis-server (6.2: no `lag` in XINFO GROUPS), and the Redis 7 path."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from infra.redis_server import free_port
from shared import names, signals
from shared.signals import group_lag, pool_lags

STREAM, GROUP = "test:stream", "workers"


@pytest.fixture(params=["str", "bytes"])
def client(request: pytest.FixtureRequest, redis_db: redis.Redis) -> Iterator[redis.Redis]:
    """The flushed db 15, through a client that decodes responses and through one that does not."""
    if request.param == "str":
        yield redis_db
        return
    kwargs = redis_db.connection_pool.connection_kwargs
    raw = redis.Redis(host=kwargs["host"], port=kwargs["port"], db=kwargs["db"], password=kwargs.get("password"),
                      decode_responses=False)
    yield raw
    raw.close()


def add(client: redis.Redis, n: int, stream: str = STREAM) -> list[str]:
    ids = [client.xadd(stream, {"payload": "x" * 300, "i": i}) for i in range(n)]
    return [i.decode() if isinstance(i, bytes) else str(i) for i in ids]


def read(client: redis.Redis, n: int, consumer: str = "c1") -> list[str]:
    reply: Any = client.xreadgroup(GROUP, consumer, {STREAM: ">"}, count=n)
    entries = reply[0][1] if reply else []
    return [e[0].decode() if isinstance(e[0], bytes) else e[0] for e in entries]


def test_missing_stream(client: redis.Redis) -> None:
    assert group_lag(client, STREAM, GROUP) == (0, 0)


def test_stream_without_the_group_counts_every_entry(client: redis.Redis) -> None:
    add(client, 4)
    assert group_lag(client, STREAM, GROUP) == (4, 0)


def test_empty_stream(client: redis.Redis) -> None:
    client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    assert group_lag(client, STREAM, GROUP) == (0, 0)


def test_entries_before_the_group_count_when_it_starts_at_zero(client: redis.Redis) -> None:
    add(client, 5)
    client.xgroup_create(STREAM, GROUP, id="0")
    assert group_lag(client, STREAM, GROUP) == (5, 0)
    add(client, 3)
    assert group_lag(client, STREAM, GROUP) == (8, 0)


def test_entries_before_the_group_do_not_count_when_it_starts_at_the_end(client: redis.Redis) -> None:
    add(client, 5)
    client.xgroup_create(STREAM, GROUP, id="$")
    assert group_lag(client, STREAM, GROUP) == (0, 0)
    add(client, 2)
    assert group_lag(client, STREAM, GROUP) == (2, 0)


def test_reading_moves_lag_to_pending_and_acking_clears_it(client: redis.Redis) -> None:
    client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    add(client, 10)
    taken = read(client, 3)
    assert len(taken) == 3
    assert group_lag(client, STREAM, GROUP) == (7, 3)
    taken += read(client, 4, consumer="c2")
    assert group_lag(client, STREAM, GROUP) == (3, 7)
    client.xack(STREAM, GROUP, *taken[:5])
    assert group_lag(client, STREAM, GROUP) == (3, 2)
    taken += read(client, 10)
    client.xack(STREAM, GROUP, *taken)
    assert group_lag(client, STREAM, GROUP) == (0, 0)


def test_deleted_and_trimmed_entries_no_longer_count(client: redis.Redis) -> None:
    client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    ids = add(client, 6)
    read(client, 2)
    client.xdel(STREAM, ids[3])
    assert group_lag(client, STREAM, GROUP) == (3, 2)
    client.xtrim(STREAM, maxlen=2, approximate=False)
    assert group_lag(client, STREAM, GROUP) == (2, 2)


def test_counting_pages_and_stops_at_the_limit(client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(signals, "PAGE", 7)  # several pages, and a last one cut short by the limit
    client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    add(client, 51)
    read(client, 1)
    assert group_lag(client, STREAM, GROUP) == (50, 1)
    assert group_lag(client, STREAM, GROUP, limit=20) == (20, 1)
    assert group_lag(client, STREAM, GROUP, limit=49) == (49, 1)


def test_other_groups_do_not_interfere(client: redis.Redis) -> None:
    client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    client.xgroup_create(STREAM, "others", id="0")
    add(client, 4)
    client.xreadgroup("others", "o", {STREAM: ">"}, count=4)
    assert group_lag(client, STREAM, GROUP) == (4, 0)
    assert group_lag(client, STREAM, "others") == (0, 4)


def test_pool_lags_reads_both_pool_streams(client: redis.Redis) -> None:
    client.xgroup_create(names.JOBS_STREAM, names.TOKENIZER_GROUP, id="0", mkstream=True)
    add(client, 3, stream=names.JOBS_STREAM)
    add(client, 1, stream=names.TOKENIZED_STREAM)
    assert pool_lags(client) == {names.TOKENIZER_POOL: (3, 0), names.INFERENCE_POOL: (1, 0)}


def test_a_wrong_type_is_an_error(client: redis.Redis) -> None:
    client.set(STREAM, "not a stream")
    with pytest.raises(redis.ResponseError):
        group_lag(client, STREAM, GROUP)


def test_binary_entries_through_a_decoding_client(client: redis.Redis) -> None:
    client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    for _ in range(6):
        client.xadd(STREAM, {"batch": b"\xff\xfe\x00arrow", "jobs": 1})
    raw = redis.Redis(connection_pool=redis.ConnectionPool(**{**client.connection_pool.connection_kwargs,
                                                               "decode_responses": False}))
    raw.xreadgroup(GROUP, "c1", {STREAM: ">"}, count=2)
    assert group_lag(client, STREAM, GROUP) == (4, 2)
    raw.close()


class Redis7:
    """The real client, with XINFO GROUPS answering as Redis 7 does (`entries-read` and `lag`)."""

    def __init__(self, real: redis.Redis, lag: int | None) -> None:
        self.real, self.lag, self.counted = real, lag, 0

    def xinfo_groups(self, stream: str) -> list[dict[str, Any]]:
        return [{**g, "entries-read": None, "lag": self.lag} for g in self.real.xinfo_groups(stream)]

    def evalsha(self, *args: Any) -> Any:
        self.counted += 1
        return self.real.evalsha(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def test_redis7_lag_field_is_used_when_present(client: redis.Redis) -> None:
    client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    add(client, 5)
    read(client, 1)
    fake = Redis7(client, lag=42)
    assert group_lag(fake, STREAM, GROUP) == (42, 1)  # type: ignore[arg-type]
    assert fake.counted == 0


def test_redis7_null_lag_falls_back_to_counting(client: redis.Redis) -> None:
    client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    add(client, 5)
    read(client, 1)
    fake = Redis7(client, lag=None)
    assert group_lag(fake, STREAM, GROUP) == (4, 1)  # type: ignore[arg-type]
    assert fake.counted == 1


@pytest.fixture(scope="module")
def redis7(tmp_path_factory: pytest.TempPathFactory) -> Iterator[redis.Redis]:
    """A Redis 7 server from PATH, where one is installed (the embedded one is 6.2)."""
    binary = shutil.which("redis-server")
    version = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout if binary else ""
    match = re.search(r"v=(\d+)\.", version)
    if binary is None or match is None or int(match.group(1)) < 7:
        pytest.skip("no redis-server 7 on PATH")
    port = free_port()
    data = str(tmp_path_factory.mktemp("redis7"))
    args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", data]
    proc = subprocess.Popen([binary, *args], stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port, decode_responses=True)
    try:
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        yield client
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)


def test_redis7_real_server(redis7: redis.Redis) -> None:
    redis7.flushdb()
    ids = add(redis7, 10)
    redis7.xgroup_create(STREAM, GROUP, id="0")
    assert redis7.xinfo_groups(STREAM)[0]["lag"] == 10
    assert group_lag(redis7, STREAM, GROUP) == (10, 0)
    read(redis7, 3)
    assert group_lag(redis7, STREAM, GROUP) == (7, 3)
    redis7.xdel(STREAM, ids[6])  # a hole after the group's position: Redis 7 answers lag NULL
    assert redis7.xinfo_groups(STREAM)[0]["lag"] is None
    assert group_lag(redis7, STREAM, GROUP) == (6, 3)
