"""Compiled grammars for the inference worker's admission (its reader thread, not the engine loop): the
tokenizer pool compiled each distinct grammar and stored it in Redis (workers/tokenizer/grammar.py); here it
is read and deserialized (~1 ms), kept in a small LRU, and compiled locally only if the stored copy expired."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import redis
import xgrammar as xgr
from transformers import AutoTokenizer

from shared import names
from shared.grammar import GrammarSpec, compile_with

CACHED = 64  # compiled grammars held (~100 KiB-1 MiB each)


class GrammarLoader:
    def __init__(self, model_path: str, client: redis.Redis, vocab_size: int) -> None:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size or None)
        self.client = client
        self.cache: OrderedDict[str, Any] = OrderedDict()
        self._compiler: xgr.GrammarCompiler | None = None

    def load(self, key: str, spec: GrammarSpec) -> Any:
        compiled = self.cache.get(key)
        if compiled is not None:
            self.cache.move_to_end(key)
            return compiled
        data = self.client.get(names.grammar_key(key))
        if data:
            compiled = xgr.CompiledGrammar.deserialize_json(data.decode() if isinstance(data, bytes) else data,
                                                            self.info)
        else:  # expired since the tokenizer pool compiled it: the spec passed its checks there, compile here
            if self._compiler is None:
                self._compiler = xgr.GrammarCompiler(self.info, max_threads=1)
            compiled = compile_with(self._compiler, spec)
        self.cache[key] = compiled
        if len(self.cache) > CACHED:
            self.cache.popitem(last=False)
        return compiled
