"""Fuzzing what the door accepts as structured output: any JSON schema, regex or choice list is either refused
by `shared.grammar.check` with a GrammarError (a 400 at the door), or compiles with xgrammar within the
tokenizer pool's bound. Nothing a client sends may stall a worker."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.grammar import GrammarError, GrammarSpec, check, compile_with, from_openai

BOUND_S = 2.0  # well inside the tokenizer pool's COMPILE_TIMEOUT_S


@pytest.fixture(scope="module")
def compiler(model_path: str):  # type: ignore[no-untyped-def]
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from shared.model_config import vocab_size

    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(model_path),
                                              vocab_size=vocab_size(model_path))
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def _accepted_compiles_quickly(compiler, spec: GrammarSpec) -> None:  # type: ignore[no-untyped-def]
    try:
        check(spec)
    except GrammarError as exc:
        assert str(exc)
        return
    t = time.perf_counter()
    try:
        compile_with(compiler, spec)
    except Exception as exc:  # noqa: BLE001 - refused by xgrammar: the tokenizer pool fails the job with it
        assert str(exc)
    assert time.perf_counter() - t < BOUND_S, spec


leaf = st.sampled_from([{"type": t} for t in ("string", "integer", "number", "boolean", "null")]) | st.builds(
    lambda n: {"type": "string", "maxLength": n}, st.integers(0, 5000)) | st.builds(
    lambda xs: {"enum": xs}, st.lists(st.text(max_size=8), max_size=40)) | st.builds(
    lambda p: {"type": "string", "pattern": p}, st.text(alphabet="ab()|*+?{}[]0-9,.\\^$", max_size=20))
schemas = st.recursive(leaf, lambda inner: st.builds(
    lambda props, req: {"type": "object", "properties": props, "required": [k for k in props if req]},
    st.dictionaries(st.text(min_size=1, max_size=6), inner, max_size=4), st.booleans()) | st.builds(
    lambda items, lo: {"type": "array", "items": items, "minItems": lo}, inner, st.integers(0, 3000)) | st.builds(
    lambda xs: {"anyOf": xs}, st.lists(inner, min_size=1, max_size=3)), max_leaves=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=schemas)
def test_any_schema_is_refused_or_compiles_within_the_bound(compiler, schema: dict) -> None:  # type: ignore[no-untyped-def, type-arg]
    try:
        spec = from_openai({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    except GrammarError as exc:
        assert str(exc)
        return
    assert spec is not None
    _accepted_compiles_quickly(compiler, spec)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(regex=st.text(alphabet="ab()|*+?{}[]0-9,.\\^$-", max_size=30))
def test_any_regex_is_refused_or_compiles_within_the_bound(compiler, regex: str) -> None:  # type: ignore[no-untyped-def]
    _accepted_compiles_quickly(compiler, GrammarSpec("regex", regex))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(choices=st.lists(st.text(max_size=30), max_size=300))
def test_any_choice_list_is_refused_or_compiles_within_the_bound(compiler, choices: list[str]) -> None:  # type: ignore[no-untyped-def]
    _accepted_compiles_quickly(compiler, GrammarSpec("choice", json.dumps(choices)))


@pytest.mark.parametrize("spec", [
    GrammarSpec("regex", "(a|aa)*b{1000}"),
    GrammarSpec("regex", "[a-z]{1,100000}"),
    GrammarSpec("json_schema", json.dumps({"enum": [str(i) for i in range(5000)]})),
    GrammarSpec("json_schema", json.dumps(json.loads("{\"type\":\"array\",\"items\":" * 40 + "{}" + "}" * 40))),
])
def test_known_worst_cases_are_refused_or_bounded(compiler, spec: GrammarSpec) -> None:  # type: ignore[no-untyped-def]
    _accepted_compiles_quickly(compiler, spec)
