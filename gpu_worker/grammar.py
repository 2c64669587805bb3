"""Compiled grammars for the inference worker's admission (its reader thread, not the engine loop).

The tokenizer pool compiled each distinct grammar and stored it in Redis (workers/tokenizer/grammar.py); here it
is read and deserialized (~20 ms for a typical 0.5 MB schema), kept in a bounded LRU by its spec's hash, and
compiled here only when the stored copy is gone (expired, or written by another xgrammar version). That spec
passed the door's checks and compiled in time once already; xgrammar releases the GIL while it compiles, so
the engine loop keeps stepping meanwhile.

xgrammar (and the tokenizer's description it needs, ~1.3 s to build) loads when the first grammar arrives, or with
GRAMMAR_WARM in a thread at the worker's start.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

import redis

from shared import names
from shared.grammar import GrammarError, GrammarSpec, compile_with, tokenizer_info

log = logging.getLogger("conveyor.inference")

CACHED = 64  # compiled grammars held (a typical one ~0.1-2 MB in memory)
CACHED_BYTES = 256 * 2**20  # and their memory together (the door admits grammars of up to ~25-30 MB each)
COMPILE_THREADS = 2  # a fallback compile shares the CPU with the engine loop


class GrammarLoader:
    def __init__(self, model_path: str, client: redis.Redis, vocab_size: int, model: str = "",
                 capacity: int = CACHED, capacity_bytes: int = CACHED_BYTES) -> None:
        """`model`: the served model's queue name ('' the default), whose compiled grammars it reads. The cache
        holds `capacity` grammars and `capacity_bytes` of them at most (the last one loaded always)."""
        self.model_path, self.client, self.capacity, self.model = model_path, client, capacity, model
        self.capacity_bytes = capacity_bytes
        self.vocab_size = vocab_size or None  # the model's logits' width (0: config.json's)
        self.cache: OrderedDict[str, tuple[Any, int]] = OrderedDict()  # spec key -> (compiled, its bytes)
        self.cached_bytes = 0
        self.loaded = self.compiled = 0  # how each grammar not in the cache was made (from Redis, compiled here)
        self._lock = threading.Lock()
        self._info: Any = None
        self._compiler: Any = None

    def load(self, spec_key: str, spec: GrammarSpec, partition: int = 0) -> Any:
        """The spec's xgrammar CompiledGrammar (stored for the jobs of `partition`); GrammarError when it can be
        neither loaded nor compiled; Redis's errors are raised."""
        with self._lock:
            held = self.cache.get(spec_key)
            if held is not None:
                self.cache.move_to_end(spec_key)
                return held[0]
            compiled = self._fetch(spec_key, partition)
            if compiled is None:
                compiled = self._compile(spec)
            size = int(getattr(compiled, "memory_size_bytes", 0))
            self.cache[spec_key] = (compiled, size)
            self.cached_bytes += size
            while len(self.cache) > 1 and (len(self.cache) > self.capacity or self.cached_bytes > self.capacity_bytes):
                self.cached_bytes -= self.cache.popitem(last=False)[1][1]
            return compiled

    def _fetch(self, spec_key: str, partition: int) -> Any:
        """The stored copy, deserialized; None when there is none that this xgrammar can read."""
        import xgrammar as xgr

        data = self.client.get(names.grammar_key(spec_key, self.model, partition))
        if not data:
            return None
        try:
            compiled = xgr.CompiledGrammar.deserialize_json(data.decode() if isinstance(data, bytes) else data,
                                                            self.info())
        except (xgr.DeserializeVersionError, xgr.DeserializeFormatError, xgr.InvalidJSONError) as exc:
            log.warning("grammar %s: the stored copy does not load (%s): compiling it here", spec_key[:12], exc)
            return None
        self.loaded += 1
        return compiled

    def _compile(self, spec: GrammarSpec) -> Any:
        import xgrammar as xgr

        if self._compiler is None:
            # (no cache of its own: xgrammar's is unbounded by default, and this loader keeps its own, bounded)
            self._compiler = xgr.GrammarCompiler(self.info(), max_threads=COMPILE_THREADS, cache_enabled=False)
        try:
            compiled = compile_with(self._compiler, spec)
        except (RuntimeError, ValueError) as exc:
            raise GrammarError(f"the grammar does not compile: {str(exc).strip().splitlines()[0]}") from None
        self.compiled += 1
        return compiled

    def warm(self) -> None:
        """Load xgrammar and build the tokenizer's description now (GRAMMAR_WARM: a thread at the worker's start); a
        grammar arriving meanwhile waits for it here, as it would have built them itself."""
        with self._lock:
            try:
                self.info()  # imports xgrammar (and transformers) on the way
            except Exception:  # a grammar arriving later tries again, and fails its own job if it must
                log.exception("the grammar loader could not warm up")

    def info(self) -> Any:
        """xgrammar's TokenizerInfo for this model (built once, as the tokenizer pool builds it)."""
        if self._info is None:
            self._info = tokenizer_info(self.model_path, self.vocab_size)
        return self._info
