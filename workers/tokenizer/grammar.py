"""Grammar compilation in the tokenizer pool (the CPU stage): each distinct grammar is compiled once, in a
child process with a time bound, and stored in Redis by its spec's hash (`names.grammar_key`) for the
inference workers to load. A grammar that does not compile, or not in time, fails its own job; the child is
replaced, and the tokenizer process itself never stalls on it. xgrammar (and torch with it) is imported
only in the child."""

from __future__ import annotations

import multiprocessing as mp
import time
from collections import OrderedDict
from multiprocessing.connection import Connection
from typing import Any

import redis

from shared import names
from shared.grammar import GrammarError, GrammarSpec

COMPILE_TIMEOUT_S = 5.0
START_TIMEOUT_S = 120.0  # the child's first answer waits for xgrammar, torch and the tokenizer to load
RECENT_S = 60.0  # a grammar stored this recently is not looked up again
RECENT_MAX = 256


def _child(conn: Connection, model_path: str) -> None:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from shared.grammar import compile_with
    from shared.model_config import vocab_size

    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(model_path),
                                              vocab_size=vocab_size(model_path))
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    conn.send(("ready", ""))
    while True:
        try:
            kind, source = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", compile_with(compiler, GrammarSpec(kind, source)).serialize_json()))
        except Exception as exc:  # noqa: BLE001 - the grammar's fault: reported to its job
            conn.send(("error", str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__))


class GrammarCompiler:
    def __init__(self, model_path: str, client: redis.Redis, ttl_s: int,
                 timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        self.model_path, self.client, self.ttl_s, self.timeout_s = model_path, client, ttl_s, timeout_s
        self._proc: Any = None
        self._conn: Connection | None = None
        self._recent: OrderedDict[str, float] = OrderedDict()

    def prepare(self, spec: GrammarSpec) -> None:
        """Make sure the compiled grammar is in Redis (its TTL refreshed); GrammarError when it cannot be."""
        key = spec.key
        now = time.monotonic()
        if now - self._recent.get(key, -RECENT_S) < RECENT_S:
            return
        if not self.client.expire(names.grammar_key(key), self.ttl_s):
            self.client.set(names.grammar_key(key), self._compile(spec), ex=self.ttl_s)
        self._recent[key] = now
        self._recent.move_to_end(key)
        while len(self._recent) > RECENT_MAX:
            self._recent.popitem(last=False)

    def _compile(self, spec: GrammarSpec) -> str:
        conn = self._child()
        conn.send((spec.kind, spec.source))
        if not conn.poll(self.timeout_s):
            self.close()  # it may compile for minutes: a fresh child takes the next grammar
            raise GrammarError(f"the grammar did not compile within {self.timeout_s:g} s")
        status, out = conn.recv()
        if status != "ok":
            raise GrammarError(f"the grammar does not compile: {out}")
        return str(out)

    def _child(self) -> Connection:
        if self._proc is not None and self._proc.is_alive() and self._conn is not None:
            return self._conn
        self.close()
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child, args=(child, self.model_path), daemon=True, name="grammar-compiler")
        self._proc.start()
        child.close()
        if not parent.poll(START_TIMEOUT_S):
            self.close()
            raise GrammarError("the grammar compiler did not start")
        parent.recv()
        self._conn = parent
        return parent

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
        if self._conn is not None:
            self._conn.close()
        self._proc, self._conn = None, None
