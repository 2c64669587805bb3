"""For the workers, which own xgrammar: how each kind of spec compiles, and the tokenizer's description every
compile and load must share. This module imports xgrammar only inside `tokenizer_info` (the API never calls it),
and takes the compiler as an argument."""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from shared.grammar.spec import GrammarError, GrammarSpec
from shared.grammar.tools import structural_tag
from shared.model_config import eos_ids


def compile_with(compiler: Any, spec: GrammarSpec) -> Any:
    """The spec compiled by an xgrammar GrammarCompiler (passed in: this module does not import xgrammar); the
    one place that says how each kind compiles, for the tokenizer pool and the inference worker's fallback alike.
    JSON comes out without free whitespace (a small model can otherwise spend its tokens on blank lines), with
    ", " and ": " as separators; a json_schema allows no properties it does not name (OpenAI's strict mode),
    a json_object any object."""
    if spec.kind == "json_schema":
        return compiler.compile_grammar(json_schema_ebnf(spec.source))
    if spec.kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if spec.kind == "regex":
        return compiler.compile_regex(spec.source)
    if spec.kind == "choice":  # EBNF string literals take JSON's escapes; non-ASCII stays as is (no surrogates)
        alternatives = (json.dumps(c, ensure_ascii=False) for c in json.loads(spec.source))
        return compiler.compile_grammar("root ::= " + " | ".join(alternatives))
    if spec.kind == "grammar":
        return compiler.compile_grammar(spec.source)
    if spec.kind == "tool_calls":  # calls held to their tools' schemas (tools.py), each as its json_schema compiles
        return compiler.compile_structural_tag(json.dumps(_schemas_as_grammars(structural_tag(spec.source))))
    raise GrammarError(f"unknown structured output kind {spec.kind!r}")


# xgrammar (0.2.8) writes a string with minLength or maxLength as characters of this class, which lets raw control
# characters (U+000B, ...) through: JSON forbids them in a string, and no client's parser reads the result. Its
# unbounded strings already use JSON's class.
_LOOSE_CHARS = r'[^\"\\\r\n]'
_JSON_CHARS = r'[^\0-\x1f\"\\]'


def json_schema_ebnf(schema: str, strict: bool = True) -> str:
    """A JSON schema's grammar as compile_with holds it: no free whitespace, ", " and ": " as separators, no
    properties it does not name (OpenAI's strict mode; `strict` false: any, as json_object takes), every string
    of JSON's characters."""
    import xgrammar as xgr

    ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict,
                                            separators=(", ", ": ")))
    return ebnf.replace(_LOOSE_CHARS, _JSON_CHARS)


def _schemas_as_grammars(node: Any) -> Any:
    """A structural tag with each json_schema content as its grammar (`json_schema_ebnf`): xgrammar's own
    json_schema content allows free whitespace, which a small model can spend its tokens on."""
    if isinstance(node, list):
        return [_schemas_as_grammars(x) for x in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema":  # `strict` false: any object (json_object), as compile_with holds one
        return {"type": "grammar", "grammar": json_schema_ebnf(json.dumps(node["json_schema"]),
                                                                node.get("strict", True))}
    return {k: _schemas_as_grammars(v) for k, v in node.items()}


@lru_cache(maxsize=4)
def tokenizer_info(model_path: str, vocab_size: int | None = None) -> Any:
    """xgrammar's TokenizerInfo for the model, the same wherever a grammar is compiled or loaded (a compiled
    grammar's masks are only right for the vocabulary it was compiled with; loading checks just its size and
    stop tokens). `vocab_size` is the model's (its logits' width; config.json's when None). Special tokens
    (<|im_start|>, ...) are barred from constrained output: xgrammar would otherwise read them as their text,
    which the detokenizer drops. The stop tokens are the model's EOS ids (config.json, generation_config.json).

    Built once per process (~1.3 s; it does not change). Imports xgrammar and transformers (and so torch): only
    the workers call it, never the API."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    config = _json_file(model_path, "config.json")
    if vocab_size is None:
        vocab_size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    generation = _json_file(model_path, "generation_config.json")
    stop = list(eos_ids(config.get("eos_token_id"), generation.get("eos_token_id")))
    if not stop and tokenizer.eos_token_id is not None:
        stop = [int(tokenizer.eos_token_id)]
    detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop or None)
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if getattr(t, "special", False)}
    size = detected.vocab_size
    vocab = [""] * size  # an empty entry is a token xgrammar never allows (besides the stop tokens)
    for text, i in tokenizer.get_vocab().items():
        if i < size and i not in special:
            vocab[i] = text
    return xgr.TokenizerInfo(vocab, detected.vocab_type, vocab_size=size, stop_token_ids=detected.stop_token_ids,
                             add_prefix_space=detected.add_prefix_space)


def _json_file(model_path: str, name: str) -> dict[str, Any]:
    try:
        with open(f"{model_path}/{name}") as f:
            value = json.load(f)
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}
