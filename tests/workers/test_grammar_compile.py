"""The tokenizer pool's grammar compiler with the real tokenizer and a real Redis: a grammar is compiled once and
stored with a TTL; a stored one is not compiled again; a grammar that does not compile, or not in time, fails
its own call, and the next one compiles as before."""

from __future__ import annotations

import json
import time

import pytest
import redis

from shared import names
from shared.grammar import GrammarError, GrammarSpec
from tests.conftest import GRAMMAR_TTL_S as TTL_S
from tests.helpers import grammar_spec
from workers.tokenizer.grammar import GrammarCompiler

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
SLOW = GrammarSpec("regex", "".join(f"[^{c}]{{1,50}}" for c in "abcd"))  # ~3 s to compile here (the door refuses it)


def test_prepare_stores_the_compiled_grammar_with_a_ttl(grammar_compiler: GrammarCompiler,
                                                        redis_db: redis.Redis) -> None:
    spec = grammar_spec(guided_json=PERSON)
    grammar_compiler.prepare(spec)
    key = names.grammar_key(spec.key)
    assert 0 < redis_db.ttl(key) <= TTL_S
    stored = json.loads(redis_db.get(key))  # xgrammar's serialized CompiledGrammar
    assert "grammar" in stored and "__VERSION__" in stored


def test_a_stored_grammar_is_not_compiled_again(grammar_compiler: GrammarCompiler, redis_db: redis.Redis) -> None:
    spec = grammar_spec(guided_regex="[0-9]{3}-[a-z]+")
    key = names.grammar_key(spec.key)
    redis_db.set(key, "stored before", ex=5)
    grammar_compiler.prepare(spec)
    assert redis_db.get(key) == "stored before"  # not compiled again...
    assert redis_db.ttl(key) > 5  # ...its TTL refreshed
    redis_db.delete(key)
    grammar_compiler.prepare(spec)  # within a minute of storing it: not even looked up
    assert not redis_db.exists(key)


def test_choices_and_grammars_compile(grammar_compiler: GrammarCompiler, redis_db: redis.Redis) -> None:
    for spec in (grammar_spec(guided_choice=["yes", "no", 'with "quotes"', "ünïcödé ✓ 🎉"]),
                 grammar_spec(guided_grammar='root ::= "(" [a-z]+ ")"'),
                 grammar_spec(response_format={"type": "json_object"})):
        grammar_compiler.prepare(spec)
        assert redis_db.exists(names.grammar_key(spec.key))


def test_a_grammar_that_does_not_compile_fails_alone(grammar_compiler: GrammarCompiler, redis_db: redis.Redis) -> None:
    with pytest.raises(GrammarError, match='^the grammar does not compile: .*Rule "foo" is not defined$'):
        grammar_compiler.prepare(GrammarSpec("grammar", "root ::= foo"))
    with pytest.raises(GrammarError, match="^the grammar does not compile: Regex parsing error at position 3"):
        grammar_compiler.prepare(GrammarSpec("regex", "a{,5}"))  # Python's re reads {,5}; xgrammar does not
    assert not redis_db.keys("*")
    good = grammar_spec(guided_regex="[a-z]+@[a-z]+")
    grammar_compiler.prepare(good)
    assert redis_db.exists(names.grammar_key(good.key))


def test_a_compile_past_the_time_bound_fails_its_own_call(model_path: str, bytes_db: redis.Redis,
                                                          redis_db: redis.Redis) -> None:
    hasty = GrammarCompiler(model_path, bytes_db, TTL_S, timeout_s=0.1)
    try:
        hasty.prepare(GrammarSpec("regex", "[0-9]+"))  # started: its child forks ready-made (~50 ms)
        start = time.monotonic()
        with pytest.raises(GrammarError, match=r"^the grammar did not compile within 0.1 s$"):
            hasty.prepare(SLOW)
        assert time.monotonic() - start < 2.0
        assert not redis_db.exists(names.grammar_key(SLOW.key))
        hasty.timeout_s = 5.0
        good = grammar_spec(guided_json={"type": "object", "properties": {"ok": {"type": "boolean"}}})
        hasty.prepare(good)  # a fresh child took over
        assert redis_db.exists(names.grammar_key(good.key))
    finally:
        hasty.close()


def test_a_grammar_too_large_once_compiled_is_refused(model_path: str, bytes_db: redis.Redis,
                                                     redis_db: redis.Redis) -> None:
    small = GrammarCompiler(model_path, bytes_db, TTL_S, max_bytes=4096)
    try:
        with pytest.raises(GrammarError, match=r"^the compiled grammar is \d+\.\d KiB; at most 4.0 KiB"):
            small.prepare(grammar_spec(guided_json=PERSON))
        small.prepare(grammar_spec(guided_regex="[0-9]"))  # a tiny one still fits
    finally:
        small.close()
    assert len(redis_db.keys("*")) == 1
