"""The embedded Redis is locked down: a password, a memory cap that refuses writes past it, and
the password kept off command lines and out of files others can read."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from infra.redis_server import RedisServer, free_port, read_local_redis_url
from shared import names

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    s = RedisServer(tmp_path / "redis", appendonly=False, maxmemory_mb=64)
    s.start()
    yield s
    s.stop()


def raw_command(port: int, command: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(command)
        return sock.recv(256)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_client_without_the_password_is_refused(server: RedisServer) -> None:
    assert raw_command(server.port, b"PING\r\n").startswith(b"-NOAUTH")
    assert raw_command(server.port, f"GET {names.STATS_KEY}\r\n".encode()).startswith(b"-NOAUTH")
    once = Retry(NoBackoff(), 0)  # redis-py retries an authentication error as a connection error otherwise
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=server.port, retry=once).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=server.port, password="guess", retry=once).ping()


def test_the_url_carries_the_password(server: RedisServer) -> None:
    assert len(server.password) >= 32  # token_urlsafe(24)
    assert server.url == f"redis://:{server.password}@127.0.0.1:{server.port}/0"
    client = redis.Redis.from_url(server.url, decode_responses=True)
    assert client.ping() and client.set("k", "v") and client.get("k") == "v"
    client.close()
    assert RedisServer(server.data_dir).password != server.password  # a new one each time


def test_memory_is_capped_and_never_evicted(server: RedisServer) -> None:
    client = redis.Redis.from_url(server.url, decode_responses=True)
    assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
    assert client.config_get("maxmemory") == {"maxmemory": str(64 * 1024 * 1024)}
    client.config_set("maxmemory", "1mb")  # full: writes are refused, nothing is dropped
    try:
        with pytest.raises(redis.ResponseError, match="maxmemory"):
            for n in range(1000):
                client.set(f"fill:{n}", "x" * 10_000)
        assert client.get("fill:0") == "x" * 10_000
    finally:
        client.flushall()
        client.close()


def test_the_password_is_not_on_the_command_line(server: RedisServer) -> None:
    assert server.proc is not None
    cmdline = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()
    assert server.password.encode() not in cmdline
    assert server.password in server.config_path.read_text()
    assert mode(server.config_path) == 0o600


def test_connection_file(server: RedisServer, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    assert read_local_redis_url(cache) is None
    path = cache / "redis" / "connection.json"
    path.parent.mkdir(parents=True)
    server.write_connection_file(path)
    assert mode(path) == 0o600
    assert json.loads(path.read_text()) == {"url": server.url, "password": server.password,
                                            "pid": server.proc.pid}  # type: ignore[union-attr]
    assert read_local_redis_url(cache) == server.url
    assert redis.Redis.from_url(read_local_redis_url(cache) or "").ping()
    path.chmod(0o644)  # rewritten: private again
    server.write_connection_file(path, pid=1)
    assert mode(path) == 0o600 and json.loads(path.read_text())["pid"] == 1
    path.write_text("{not json")
    assert read_local_redis_url(cache) is None


def test_a_given_password_and_a_restart(tmp_path: Path) -> None:
    s = RedisServer(tmp_path / "redis", password='with space "and" quotes', appendonly=True)
    s.start()
    try:
        redis.Redis.from_url(s.url).set("kept", "1")
        s.stop()
        s.start()  # same port, same password, same append-only file
        assert redis.Redis.from_url(s.url).get("kept") == b"1"
    finally:
        s.stop()


def test_run_foreground_prints_the_url_and_leaves_the_connection_file(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "CONVEYOR_CACHE": str(tmp_path), "REDIS_PORT": str(port)}
    env.pop("REDIS_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "infra.cli", "redis"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        line = proc.stdout.readline().decode()  # type: ignore[union-attr]
        url = read_local_redis_url(tmp_path)
        assert url is not None and url in line and f"127.0.0.1:{port}/0" in url
        info = json.loads((tmp_path / "redis" / "connection.json").read_text())
        assert info["pid"] == proc.pid  # the process became redis-server
        assert info["password"] not in Path(f"/proc/{proc.pid}/cmdline").read_text()
        client = redis.Redis.from_url(url)
        deadline = time.monotonic() + 15
        while True:
            try:
                assert client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)
        assert raw_command(port, b"PING\r\n").startswith(b"-NOAUTH")
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_stacks_connection_file_names_its_partitions_and_models(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`conveyor up --redis-cluster N` and `--model` set REDIS_PARTITIONS and MODELS in the stack's environment:
    its Redis's connection file carries them for the commands run from another shell (shared/paths.py)."""
    from infra.embedded_redis import EmbeddedRedis
    from shared.paths import read_connection
    from shared.settings import Settings

    monkeypatch.setenv("REDIS_PARTITIONS", "12")
    monkeypatch.setenv("MODELS", f"a={tmp_path}")
    embedded = EmbeddedRedis(Settings(CONVEYOR_CACHE=tmp_path))  # type: ignore[call-arg]
    embedded.start()
    try:
        info = read_connection(tmp_path)
        assert info["url"] == embedded.url and info["env"] == {"REDIS_PARTITIONS": "12", "MODELS": f"a={tmp_path}"}
    finally:
        embedded.stop()


def test_a_damaged_append_only_file_is_said_with_what_repairs_it(tmp_path: Path) -> None:
    """Redis refuses to start on a damaged append-only file and its log advises `redis-check-aof --fix`, which the
    embedded server's wheel does not ship: the error says where the file is and where that tool comes from."""
    s = RedisServer(tmp_path / "redis")
    s.start()
    client = redis.Redis.from_url(s.url)
    client.set("k", "v" * 100)
    client.close()
    s.stop()
    aof = max((p for p in (tmp_path / "redis").rglob("*.aof") if p.is_file()), key=lambda p: p.stat().st_size)
    data = aof.read_bytes()
    aof.write_bytes(data[: len(data) // 2] + b"*garbage\r\n" + data[len(data) // 2 :])
    with pytest.raises(RuntimeError) as failed:
        RedisServer(tmp_path / "redis", password=s.password).start()
    assert "is damaged" in str(failed.value) and "redis-tools" in str(failed.value), failed.value
