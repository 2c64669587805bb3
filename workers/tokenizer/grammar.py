"""Grammar compilation in the tokenizer pool (the CPU stage): each distinct grammar is compiled once and stored
in Redis by its spec's hash and its jobs' partition (`names.grammar_key`), as xgrammar's serialized JSON, for the
inference workers to load (gpu_worker/grammar.py).

The compile runs in a child process with a time bound: a grammar that does not compile in COMPILE_TIMEOUT_S
fails its own job, the child is killed and a fresh one takes the next grammar, and the tokenizer process never
waits longer than that on one grammar. The door's checks (shared/grammar.py) make that rare. xgrammar, and torch
with it, load only in the child (this process stays torch-free). Children come from a forkserver that has
imported xgrammar, and the first child hands back the tokenizer's description (xgrammar's TokenizerInfo,
serialized) for later ones, so a replacement starts in ~50 ms instead of ~3.5 s.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import re
import signal
import threading
import time
from collections import OrderedDict
from multiprocessing.connection import Connection
from typing import Any

import redis

from shared import names
from shared.grammar import GrammarError, GrammarSpec

log = logging.getLogger("conveyor.tokenizer")

COMPILE_TIMEOUT_S = 5.0  # the door's estimate admits grammars compiling in ~1 s on 2 cores: 5x headroom
START_TIMEOUT_S = 120.0  # the first child loads xgrammar, torch and the tokenizer (~3.5 s; more on a cold disk)
RECENT_S = 60.0  # a grammar stored (or refreshed) this recently is not looked up again
RECENT_MAX = 1024
# the serialized grammar's size (Redis holds it; every inference worker that meets it reads it): typical schemas
# are 0.1-1 MB, what the door's estimate admits up to ~25 MB
MAX_COMPILED_BYTES = 32 * 2**20
COMPILE_THREADS = min(8, os.cpu_count() or 1)  # xgrammar builds a grammar's token masks in parallel
CACHE_BYTES = 256 * 2**20  # the child's own cache of compiled grammars (one whose Redis copy expired)

# xgrammar's messages start with a time and its source file: "[05:14:26] /project/cpp/x.cc:83: Regex parsing..."
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")
# the tokenizer's TokenizerInfo (serialized) by model, from the first child that built it: later children start
# from it in ~20 ms instead of ~1.3 s
_INFOS: dict[str, str] = {}


class GrammarCompiler:
    """Compiled grammars into Redis, each under its spec's hash with a TTL; one compile at a time."""

    def __init__(self, model_path: str, client: redis.Redis, ttl_s: int, timeout_s: float = COMPILE_TIMEOUT_S,
                 start_timeout_s: float = START_TIMEOUT_S, max_bytes: int = MAX_COMPILED_BYTES,
                 model: str = "") -> None:
        """`model`: the queue name of the model at `model_path` ('' the default), whose grammars these are."""
        self.model_path, self.client, self.ttl_s, self.model = model_path, client, int(ttl_s), model
        self.timeout_s, self.start_timeout_s, self.max_bytes = timeout_s, start_timeout_s, max_bytes
        self.recent_s = min(RECENT_S, self.ttl_s / 4)  # well inside the TTL it refreshes
        self._recent: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()
        self._proc: Any = None
        self._conn: Connection | None = None
        self._ready = False

    def warm(self) -> None:
        """Start the child now, without waiting for it (the first grammar then waits less)."""
        with self._lock:
            if self._proc is None:
                self._start()

    def prepare(self, spec: GrammarSpec, partition: int = 0) -> None:
        """Make sure the compiled grammar is in Redis for the jobs of `partition`, its TTL refreshed: compiled here
        if it is not there (the child's cache has one compiled for another partition). GrammarError, with a message
        for the client, when it does not compile, not in time, or is too large; Redis's errors are raised."""
        key = names.grammar_key(spec.key, self.model, partition)
        with self._lock:
            now = time.monotonic()
            if now - self._recent.get(key, -self.recent_s) < self.recent_s:
                return
            if not self.client.expire(key, self.ttl_s):  # not there (or expired): compile and store it
                self.client.set(key, self._compile(spec), ex=self.ttl_s)
            self._recent[key] = now
            self._recent.move_to_end(key)
            while len(self._recent) > RECENT_MAX:
                self._recent.popitem(last=False)

    def forget(self) -> None:
        """Forget which grammars were stored lately (their store was emptied): the next prepare looks again."""
        self._recent.clear()

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _compile(self, spec: GrammarSpec) -> str:
        conn = self._child()
        started = time.monotonic()
        conn.send((spec.kind, spec.source, self.max_bytes))
        if not conn.poll(self.timeout_s):
            log.warning("a %s grammar did not compile within %g s: replacing the compiler process", spec.kind,
                        self.timeout_s)
            self._stop()  # it may compile for minutes: a fresh child takes the next grammar
            self._start()
            raise GrammarError(f"the grammar did not compile within {self.timeout_s:g} s")
        try:
            status, out = conn.recv()
        except EOFError:  # the child died (out of memory?): the next grammar gets a fresh one
            self._stop()
            raise GrammarError("the grammar compiler failed on this grammar") from None
        if status == "too large":
            raise GrammarError(f"the compiled grammar is {_size(int(out))}; at most {_size(self.max_bytes)}: "
                               "simplify it")
        if status != "ok":
            raise GrammarError(f"the grammar does not compile: {out}")
        log.debug("compiled a %s grammar in %.3f s (%d bytes)", spec.kind, time.monotonic() - started, len(out))
        return str(out)

    def _child(self) -> Connection:
        """The child's end, once it is ready (started now if there is none)."""
        if self._proc is None or not self._proc.is_alive():
            self._stop()
            self._start()
        assert self._conn is not None
        if not self._ready:
            if not self._conn.poll(self.start_timeout_s):
                self._stop()
                raise GrammarError("the grammar compiler did not start")
            try:
                status, info = self._conn.recv()
            except EOFError:
                self._stop()
                raise GrammarError("the grammar compiler did not start") from None
            if status != "ready":
                self._stop()
                raise GrammarError(f"the grammar compiler did not start: {info}")
            _INFOS.setdefault(self.model_path, info)
            self._ready = True
        return self._conn

    def _start(self) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["xgrammar"])  # children fork with it imported (if the server is not up yet)
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, self.model_path, _INFOS.get(self.model_path)),
                                 daemon=True, name="grammar-compiler")
        self._proc.start()
        child.close()
        self._conn, self._ready = parent, False

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
        if self._conn is not None:
            self._conn.close()
        self._proc, self._conn, self._ready = None, None, False


def _serve(conn: Connection, model_path: str, info_json: str | None) -> None:
    """The child: compile grammars one at a time, answering ("ok", serialized) or ("error", message)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when this process ends
    try:
        import xgrammar as xgr

        from shared.grammar import compile_with, tokenizer_info

        info = xgr.TokenizerInfo.deserialize_json(info_json) if info_json else tokenizer_info(model_path)
        compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_limit_bytes=CACHE_BYTES)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the grammar's job
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", info_json or info.serialize_json()))
    while True:
        try:
            kind, source, max_bytes = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        try:
            text = compile_with(compiler, GrammarSpec(kind, source)).serialize_json()
        except Exception as exc:  # noqa: BLE001 - the grammar's fault: reported to its job
            conn.send(("error", _message(exc)))
            continue
        conn.send(("too large", len(text)) if len(text) > max_bytes else ("ok", text))


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _message(exc: Exception) -> str:
    """xgrammar's message, without its time and source location."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return _LOCATION.sub("", lines[0]) if lines else type(exc).__name__
