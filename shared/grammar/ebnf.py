"""The door's checks on an EBNF grammar (xgrammar's GBNF dialect), which only the compiler parses: here, that it
has a root rule, and its bounded repetitions are counted as if over wide sets (the parse would tell, at a cost)."""

from __future__ import annotations

import re

from shared.grammar.cost import WIDE, Cost
from shared.grammar.limits import MAX_REPEAT
from shared.grammar.spec import GrammarError

_ROOT = re.compile(r"^\s*root\s*::=", re.MULTILINE)
_REPEAT = re.compile(r"\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")  # {n}, {m,}, {m,n} and {,n}


def check_ebnf(source: str, cost: Cost) -> None:
    if not _ROOT.search(source):
        raise GrammarError("the grammar needs a rule named root (root ::= ...)")
    for m in _REPEAT.finditer(source):
        lo, hi = m.group(1), m.group(2)
        if not lo and not hi:
            continue  # {} or {,}: not a count (the compiler answers for it)
        count = int(hi) if hi else int(lo)
        if count > MAX_REPEAT:
            raise GrammarError(f"the grammar repeats {count} times ({m.group(0)}); at most {MAX_REPEAT}")
        if count > 1:
            cost.repeat(WIDE, count, f"{m.group(0)} in the grammar", None)
