"""What bench/chaos.py and bench/soak.py share: start `conveyor up` as a child, find its processes
by role (psutil over the supervisor's process tree), read SSE streams, stop everything again."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = str(Path.home() / ".cache" / "conveyor" / "models" / "SmolLM2-135M-Instruct")


@dataclass
class Stack:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    env: dict[str, str]
    seen: set[int] = field(default_factory=set)  # every pid of the tree we ever saw, for the final check

    def tree(self) -> list[tuple[str, psutil.Process]]:
        out = process_tree(self.proc.pid)
        self.seen.update(p.pid for _, p in out)
        return out

    def by_role(self, role: str) -> list[psutil.Process]:
        return [p for r, p in self.tree() if r == role]


def process_tree(sup_pid: int) -> list[tuple[str, psutil.Process]]:
    """(role, process) for the supervisor and every descendant: supervisor, redis-server, api,
    tokenizer, inference, output-lane (a spawn child of an inference worker), celery, celery-beat,
    mp-helper."""
    try:
        root = psutil.Process(sup_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    out = []
    for p in procs:
        role = classify(p, sup_pid)
        if role:
            out.append((role, p))
    return out


def classify(p: psutil.Process, sup_pid: int) -> str | None:
    try:
        if p.pid == sup_pid:
            return "supervisor"
        name = p.name()
        cmd = " ".join(p.cmdline())
        if "redis-server" in name or "redis-server" in cmd:
            return "redis-server"
        for role in ("api", "tokenizer", "inference"):
            if re.search(rf"infra\.cli {role}\b", cmd):
                return role
        if "spawn_main" in cmd:
            parent = p.parent()
            if parent is not None and "infra.cli inference" in " ".join(parent.cmdline()):
                return "output-lane"
            return "mp-helper"
        if "workers.celery_app" in cmd:  # the worker, and beat forked from it
            parent = p.parent()
            return "celery-beat" if parent is not None and "workers.celery_app" in " ".join(parent.cmdline()) \
                else "celery"
        if "resource_tracker" in cmd or "forkserver" in cmd:
            return "mp-helper"
        return "other"
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def start_stack(workdir: Path, port: int, model: str, env_extra: dict[str, str], tokenizers: int,
                inference: int, redis_url: str | None = None) -> Stack:
    """`conveyor up --no-autoscale`; with redis_url None the supervisor starts its own Redis
    (REDIS_PORT in env_extra fixes its port) under workdir/cache/redis."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL",)}
    env.update({"PORT": str(port), "HOST": "127.0.0.1", "MODEL": model, "CONVEYOR_CACHE": str(workdir / "cache"),
                "LOG_LEVEL": "INFO", "PYTHONUNBUFFERED": "1"})
    if redis_url:
        env["REDIS_URL"] = redis_url
    env.update(env_extra)
    log = workdir / "stack.log"
    proc = subprocess.Popen([sys.executable, "-m", "infra.cli", "up", "--no-autoscale", "--tokenizers",
                             str(tokenizers), "--inference", str(inference)], env=env, cwd=ROOT,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    return Stack(proc, f"http://127.0.0.1:{port}", log, env)


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float, what: str = "",
              each_poll: Any = None) -> None:
    """Poll `url` until it answers 200, failing early if `proc` exits."""
    what = what or url
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what}: exited with {proc.returncode} before it was ready")
        if each_poll is not None:
            each_poll()
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{what}: not ready after {timeout:.0f}s")


def wait_ready(stack: Stack, timeout: float = 300.0, path: str = "/readyz") -> None:
    wait_http(stack.url + path, stack.proc, timeout, f"the stack (log {stack.log})", stack.tree)


def stop_stack(stack: Stack, timeout: float = 90.0) -> list[int]:
    """SIGTERM the supervisor (it drains and stops its children); SIGKILL what is left after the
    timeout. Returns the pids of the tree that were still alive and had to be killed."""
    stack.tree()
    if stack.proc.poll() is None:
        stack.proc.send_signal(signal.SIGTERM)
        try:
            stack.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            stack.proc.kill()
            stack.proc.wait()
    leftovers = []
    deadline = time.monotonic() + 5
    for pid in sorted(stack.seen):
        if pid == stack.proc.pid:
            continue
        try:
            p = psutil.Process(pid)
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            p.wait(max(0.0, deadline - time.monotonic()))
        except psutil.TimeoutExpired:
            leftovers.append(pid)
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        except psutil.NoSuchProcess:
            pass
    return leftovers


def scan_log(path: Path) -> dict[str, Any]:
    """Counts of what matters in the stack's log: tracebacks, errors, crashes, claims, warnings."""
    text = path.read_text(errors="replace") if path.exists() else ""
    lines = text.splitlines()
    exits = [ln for ln in lines if re.search(r"pid \d+ exited with", ln)]
    errors = [ln for ln in lines if " ERROR " in ln or " CRITICAL " in ln]
    warnings: dict[str, int] = {}
    for ln in lines:
        if " WARNING " in ln:
            msg = re.sub(r"^.*? WARNING ", "", ln)
            msg = re.sub(r"\[\d+\]", "[N]", msg)
            msg = re.sub(r"\d+(\.\d+)?", "N", msg)[:160]
            warnings[msg] = warnings.get(msg, 0) + 1
    return {
        "lines": len(lines),
        "tracebacks": text.count("Traceback (most recent call last)"),
        "errors": errors,
        "exits": exits,
        "claims": sum("claimed " in ln for ln in lines),
        "warnings": warnings,
    }


def error_reason(msg: str) -> str:
    return re.sub(r"\d+", "N", msg or "")[:120]


async def read_sse(client: httpx.AsyncClient, path: str, timeout: float = 120.0) -> list[dict[str, Any]]:
    """Every event of an SSE stream up to and including `done` or `error` (status events too)."""
    out: list[dict[str, Any]] = []
    async with client.stream("GET", path, timeout=timeout) as resp:
        if resp.status_code != 200:
            body = await resp.aread()
            raise RuntimeError(f"GET {path} -> {resp.status_code}: {body[:200]!r}")
        async for ev in iter_sse(resp):
            out.append(ev)
            if ev.get("event") in ("done", "error"):
                break
    return out


class HttpStatusError(Exception):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:200]!r}")
        self.status = status


async def post_sse_data(url: str, path: str, body: bytes, timeout: float) -> AsyncIterator[bytes]:
    """POST a JSON body and yield each SSE `data:` payload of the response as it arrives; `timeout`
    bounds the connect and each read, as a read timeout does (a slow but live stream is not cut).

    A load generator shares the CPU with the server it measures, so this is HTTP/1.1 on a bare
    asyncio connection (one per request, chunked transfer decoded, SSE lines split by hand). In a
    closed loop at 32 streams it used 3% of one core where httpx's `aiter_lines` used 7%.
    Use it with `contextlib.aclosing` when stopping early, so the connection closes at once."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"an http:// URL is needed, not {url!r}")
    host, port = parts.hostname, parts.port or 80
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=2**20), timeout)
    try:
        writer.write(f"POST {parts.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {host}\r\n"
                     f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        status = int(head.split(b" ", 2)[1])
        chunked = b"transfer-encoding: chunked" in head.lower()
        if status != 200:
            raise HttpStatusError(status, await asyncio.wait_for(reader.read(), timeout))
        rest = b""
        while True:
            if chunked:
                size_line = await asyncio.wait_for(reader.readline(), timeout)
                if not size_line.strip():
                    raise asyncio.IncompleteReadError(size_line, None)  # closed mid-stream
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    return
                data = (await asyncio.wait_for(reader.readexactly(size + 2), timeout))[:-2]
            else:
                data = await asyncio.wait_for(reader.read(65536), timeout)
                if not data:
                    return
            *lines, rest = (rest + data).split(b"\n")
            for line in lines:
                if line.startswith(b"data:"):
                    yield line[5:].strip()
    finally:
        writer.close()


async def iter_sse(resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    event: dict[str, Any] = {}
    async for line in resp.aiter_lines():
        if line == "":
            if "event" in event or "data" in event:
                yield event
            event = {}
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            event[name] = event.get(name, "") + ("\n" if name == "data" and name in event else "") + value


def check_events(events: list[dict[str, Any]], final_text: str) -> str | None:
    """None when the token events have seqs 1..n and concatenate to final_text; else what is wrong."""
    tokens = [e for e in events if e.get("event") == "token"]
    seqs = [int(e.get("id", -1)) for e in tokens]
    if not events or events[-1].get("event") != "done":
        return "no done event"
    if seqs != list(range(1, len(seqs) + 1)):
        return f"seqs not contiguous: {seqs[:10]}..."
    text = "".join(json.loads(e["data"])["text"] for e in tokens)
    if text != final_text:
        return f"replay text differs from the final text ({len(text)} vs {len(final_text)} chars)"
    return None


def tree_state() -> str:
    """The code a run measured: HEAD, plus a digest of uncommitted changes to tracked files."""
    import hashlib

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        diff = subprocess.run(["git", "diff", "HEAD"], cwd=ROOT, capture_output=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + (f" + uncommitted changes (diff sha1 {hashlib.sha1(diff).hexdigest()[:10]})" if diff else "")


def md_table(headers: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)
