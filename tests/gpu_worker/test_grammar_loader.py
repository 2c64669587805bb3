"""The inference worker's grammar loader with the real tokenizer and a real Redis: it loads what the tokenizer
pool stored, keeps a bounded LRU, and compiles a grammar itself when the stored copy is gone or unreadable."""

from __future__ import annotations

import threading

import pytest
import redis
import xgrammar as xgr

from gpu_worker.grammar import GrammarLoader
from shared import names
from shared.grammar import GrammarError, GrammarSpec, tokenizer_info
from shared.model_config import vocab_size
from tests.helpers import grammar_spec
from workers.tokenizer.grammar import GrammarCompiler

CODE = r"[0-9]{3}-[a-z]+"


@pytest.fixture
def loader(model_path: str, bytes_db: redis.Redis, redis_db: redis.Redis,
           grammar_compiler: GrammarCompiler) -> GrammarLoader:
    made = GrammarLoader(model_path, bytes_db, vocab_size(model_path) or 0, capacity=2)
    made.info()  # the tokenizer's description: built once per process (~1.3 s)
    grammar_compiler.prepare(GrammarSpec("regex", "warm"))  # and the compiler's child ready
    return made


def _matches(compiled: xgr.CompiledGrammar, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiled)
    return bool(matcher.accept_string(text)) and bool(matcher.is_completed())


def test_it_loads_what_the_tokenizer_pool_stored(grammar_compiler: GrammarCompiler, loader: GrammarLoader,
                                                 redis_db: redis.Redis) -> None:
    spec = grammar_spec(guided_regex=CODE)
    grammar_compiler.prepare(spec)
    compiled = loader.load(spec.key, spec)
    assert (loader.loaded, loader.compiled) == (1, 0)
    assert _matches(compiled, "123-abc") and not _matches(compiled, "12-abc")
    redis_db.delete(names.grammar_key(spec.key))
    assert loader.load(spec.key, spec) is compiled  # held: Redis is not read again


def test_warming_beside_a_first_grammar_builds_the_description_once(model_path: str, bytes_db: redis.Redis,
                                                                    grammar_compiler: GrammarCompiler,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """GRAMMAR_WARM's thread and the first grammar at once: the grammar waits for the warm-up and loads whole, and
    the tokenizer's description is built once."""
    import gpu_worker.grammar as loader_module

    built: list[int] = []

    def counted(*args: object) -> object:
        built.append(1)
        return tokenizer_info(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(loader_module, "tokenizer_info", counted)
    made = GrammarLoader(model_path, bytes_db, vocab_size(model_path) or 0)
    spec = grammar_spec(guided_regex=CODE)
    grammar_compiler.prepare(spec)
    warm = threading.Thread(target=made.warm)
    warm.start()
    compiled = made.load(spec.key, spec)
    warm.join()
    assert built == [1] and (made.loaded, made.compiled) == (1, 0)
    assert _matches(compiled, "123-abc") and not _matches(compiled, "12-abc")


def test_a_missing_or_unreadable_copy_is_compiled_here(loader: GrammarLoader, redis_db: redis.Redis) -> None:
    spec = grammar_spec(guided_json={"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})
    compiled = loader.load(spec.key, spec)  # nothing stored (expired)
    assert (loader.loaded, loader.compiled) == (0, 1)
    assert _matches(compiled, '{"ok": true}')
    other = grammar_spec(guided_choice=["yes", "no"])
    redis_db.set(names.grammar_key(other.key), '{"written by": "another xgrammar"}')
    assert _matches(loader.load(other.key, other), "no")
    assert (loader.loaded, loader.compiled) == (0, 2)


def test_the_cache_is_bounded(loader: GrammarLoader) -> None:
    specs = [grammar_spec(guided_regex=f"[a-z]{{{n}}}") for n in (1, 2, 3)]
    first = loader.load(specs[0].key, specs[0])
    loader.load(specs[1].key, specs[1])
    loader.load(specs[2].key, specs[2])
    assert list(loader.cache) == [specs[1].key, specs[2].key]
    assert loader.load(specs[0].key, specs[0]) is not first  # evicted, made again


def test_a_grammar_that_does_not_compile_here_raises(loader: GrammarLoader) -> None:
    with pytest.raises(GrammarError, match='Rule "foo" is not defined'):
        loader.load("x" * 64, GrammarSpec("grammar", "root ::= foo"))


def test_the_cache_is_bounded_by_bytes_too(loader: GrammarLoader) -> None:
    """Grammars held past the byte budget go, oldest first; the one just loaded stays, however large."""
    specs = [grammar_spec(guided_choice=[f"a{i}", f"b{i}"]) for i in range(2)]
    first = loader.load(specs[0].key, specs[0])
    loader.capacity_bytes = first.memory_size_bytes  # room for one such grammar
    loader.load(specs[1].key, specs[1])
    assert list(loader.cache) == [specs[1].key] and loader.cached_bytes == loader.cache[specs[1].key][1] > 0
    loader.capacity_bytes = 1
    assert loader.load(specs[0].key, specs[0]) is not None and list(loader.cache) == [specs[0].key]
