"""Small clients for the tests: submit, wait, read SSE streams (harness/sse.py's reader), wait on any
condition with a deadline instead of sleeping, and the API in this process."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast
from unittest import mock

import httpx
import redis

import harness.stack
from harness.sse import iter_sse, read_events, tokens_text
from shared import names
from shared.grammar import GrammarSpec, from_openai
from shared.jobs import TERMINAL
from shared.redis_client import text
from shared.settings import Settings

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = ["blocked_on", "chat", "conveyor", "in_process_api", "iter_sse", "read_events", "submit", "tokens_text",
           "auntil", "until", "wait"]


def submit(client: httpx.Client, **body: Any) -> dict[str, Any]:
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == 202, r.text
    return r.json()


def wait(client: httpx.Client, job_id: str, timeout: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        r = client.get(f"/v1/jobs/{job_id}")
        if r.status_code == 503:  # Redis out of reach for a moment: a polling client retries, as told
            job = r.json()
            time.sleep(0.2)
            continue
        assert r.status_code == 200, f"polling {job_id}: {r.status_code} {r.text}"
        job = r.json()
        if job["status"] in TERMINAL:
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not end: {job}")


def chat(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


T = TypeVar("T")


def until(what: str, condition: Callable[[], T], timeout: float = 5.0, every: float = 0.01) -> T:
    """The first truthy value of `condition()`; fails the test naming `what` once `timeout` has passed."""
    return harness.stack.until(what, condition, timeout, every, error=AssertionError)


async def auntil(what: str, condition: Callable[[], Awaitable[T]], timeout: float = 5.0, every: float = 0.05) -> T:
    """`until` for a coroutine's answer, without blocking the event loop in between."""
    deadline = time.monotonic() + timeout
    while not (got := await condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(every)
    return got


def blocked_on(r: redis.Redis, command: str) -> list[dict[str, str]]:
    """The clients of `r`'s database that are blocked in `command` (lower case) right now."""
    db = str(r.connection_pool.connection_kwargs.get("db", 0))
    return [c for c in r.client_list() if c.get("cmd") == command and "b" in c.get("flags", "")
            and c.get("db") == db]


def grammar_spec(**params: object) -> GrammarSpec:
    """The grammar an OpenAI request's structured-output fields ask for (guided_json=..., response_format=...)."""
    spec = from_openai(**params)  # type: ignore[arg-type]
    assert spec is not None
    return spec


def conveyor(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The `conveyor` CLI's answer to `argv`, as its process would give it (exit code, stdout, stderr), run through
    its own `main` in this process with `env` set (a subprocess would import the stack's modules again, ~1 s each)."""
    from infra.cli import main
    from shared.settings import get_settings

    out, err = io.StringIO(), io.StringIO()
    code: int | str | None = 0
    with mock.patch.dict(os.environ, env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        get_settings.cache_clear()  # the settings are read from `env`, as a new process would read them
        try:
            main(list(argv))
        except SystemExit as exc:
            code = exc.code
        finally:
            get_settings.cache_clear()
    if isinstance(code, str):  # sys.exit("message"): the interpreter prints it and exits 1
        err.write(code + "\n")
        code = 1
    return subprocess.CompletedProcess(["conveyor", *argv], code or 0, out.getvalue(), err.getvalue())


@contextlib.asynccontextmanager
async def in_process_api(settings: Settings,
                         extend: Callable[[FastAPI], None] | None = None) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the API run in this process on `settings` (no workers), its lifespan entered; `extend` adds to
    the app first (a route of the test's own). The database of `settings.redis_url` is emptied after."""
    from api.main import create_app

    app = create_app(settings)
    if extend is not None:
        extend(app)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client
    r = redis.Redis.from_url(settings.redis_url)
    r.flushdb()
    r.close()


def fill(r: redis.Redis) -> list[str]:
    """Write junk until Redis (at its maxmemory, noeviction) refuses even a small write; the junk's keys. Its
    maxmemory is then lowered by FILL_MARGIN below what it uses: Redis frees an idle client's query buffer (the
    filler's held a 1 MiB value) a moment later, which took it back under its limit, and a write a test expected
    refused went through (once, in a fresh-clone run). The caller restores maxmemory, where it outlives the test."""
    keys: list[str] = []
    for size in (1 << 20, 1 << 14, 1 << 8):
        try:
            while True:
                keys.append(f"junk:{len(keys)}")
                r.set(keys[-1], b"x" * size)
        except redis.exceptions.OutOfMemoryError:
            keys.pop()
    used = int(cast(dict[str, Any], r.info("memory"))["used_memory"])
    r.config_set("maxmemory", max(1 << 20, used - FILL_MARGIN))
    return keys


FILL_MARGIN = 4 << 20


@contextlib.contextmanager
def writes_refused(r: redis.Redis, how: str, scratch: Path | None = None) -> Iterator[None]:
    """Redis refusing every write while inside, then taking writes again: `full` (filled to its maxmemory, with
    noeviction: OOM), `no replicas` (`min-replicas-to-write` 1 with none: NOREPLICAS) or `failed save` (its last
    RDB save failed, its directory gone as a failed disk leaves it: MISCONF; on a Redis without AOF; `scratch`: a
    directory that does not exist yet)."""
    junk: list[str] = []
    [old_dir] = map(text, r.config_get("dir").values())
    [old_max] = map(text, r.config_get("maxmemory").values())
    if how == "full":
        junk = fill(r)
    elif how == "no replicas":
        r.config_set("min-replicas-to-write", 1)
    elif how == "failed save" and scratch is not None:
        scratch.mkdir()
        r.config_set("dir", str(scratch))
        scratch.rmdir()
        r.config_set("save", "3600 1")
        r.bgsave()
        until("the save failed", lambda: _saved(r) == "err", timeout=30)
    else:
        raise ValueError(how)
    try:
        yield
    finally:
        if junk:
            r.delete(*junk)
            r.config_set("maxmemory", old_max)
        r.config_set("min-replicas-to-write", 0)
        if how == "failed save":
            r.config_set("dir", old_dir)
            r.bgsave()
            until("the save succeeded", lambda: _saved(r) == "ok", timeout=30)
            r.config_set("save", "")


def _saved(r: redis.Redis) -> str:
    """The last RDB save's status once none runs ("ok", "err"); "" while one does."""
    info = r.info("persistence")
    return "" if int(info["rdb_bgsave_in_progress"]) else str(info["rdb_last_bgsave_status"])


def master_of(r: Any, partition: int) -> Any:
    """The master (a cluster client's node) that holds the partition's jobs."""
    return r.get_node_from_key(names.job_key(names.job_id_in(partition, "a0" * 16)))


def partitions_elsewhere(r: Any, partition: int) -> list[int]:
    """The partitions whose jobs another master than the partition's holds."""
    name = master_of(r, partition).name
    return [p for p in names.partitions() if master_of(r, p).name != name]
