"""Structured output's one record (GrammarSpec), made from OpenAI's `response_format` or vLLM's `guided_*` /
`structured_outputs` (params.py) or from `tools` and `tool_choice` (tools.py), and the door's checks that every
accepted grammar compiles quickly (bounds.py: limits.py, cost.py, and each kind's own module: schema.py, regex.py,
choice.py, ebnf.py, tools.py).

Pure Python: the API imports this package, and it never imports xgrammar or torch (compiler.py's
`tokenizer_info` imports them when the workers call it). The tokenizer pool compiles each grammar in a child
process with a time bound (workers/tokenizer/grammar.py), so a grammar these checks let through that still
compiles slowly fails its own job and nothing else; the checks are there so that this stays rare and the client
is told why at once.
"""

from shared.grammar.bounds import check
from shared.grammar.compiler import compile_with, tokenizer_info
from shared.grammar.limits import MAX_CHOICES, MAX_DEPTH, MAX_ENTRIES, MAX_SOURCE_BYTES
from shared.grammar.params import from_openai
from shared.grammar.spec import GrammarError, GrammarSpec
from shared.grammar.tools import tools_spec

__all__ = ["MAX_CHOICES", "MAX_DEPTH", "MAX_ENTRIES", "MAX_SOURCE_BYTES", "GrammarError", "GrammarSpec", "check",
           "compile_with", "from_openai", "tokenizer_info", "tools_spec"]
