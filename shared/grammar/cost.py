"""The cost model: a spec's estimated compile time with xgrammar, in ms, on the safe side.

What costs xgrammar time, measured on a 2-core CPU with the 49,152-token vocabulary (the compile builds,
for every state of the grammar, which tokens may come next):
- bounded repetitions of a wide character set: `.{1,100}` ~1.1 s, a JSON string with maxLength 256 ~2.4 s
  (`[a-z]{1,100}` ~0.17 s, `\\d{1,100}` ~0.02 s); the cost stops growing at ~150-256 repetitions, and
  distinct ones add up (20 strings of distinct maxLength near 50: 22 s);
- bounded arrays: ~(maxItems)^2 (10 arrays of maxItems ~128: 3.8 s);
- long literals among alternatives (enum, const, choices): ~(length)^2 (32 choices of 1,000 characters: 1.3 s);
- enums of very many entries (20,000: 13 s; 5,000: 0.07 s) and objects of very many properties (~3 ms each).
Unbounded repetitions (`.*`, `a+`), deep nesting, large counts of narrow sets (`a{1,100000}`), a few integer
ranges and `$ref` recursion are cheap; but many bounded states together cost more than their sum (30 distinct
`[0-9]`-like sets {1,128}: 32 s). So the checks add up an estimate of compile time (Cost) and refuse a spec
over COMPILE_BUDGET_MS, naming what costs most.
"""

from __future__ import annotations

from typing import Any

from shared.grammar.limits import COMPILE_BUDGET_MS
from shared.grammar.spec import GrammarError

WIDE = 129  # a set of at least this many characters is wide (the most costly kind)
_MEDIUM = 17  # at least this many: medium (fewer: narrow)
_SATURATION = 256  # repetitions beyond this cost no more
_MS_PER_REPEAT = {"wide": 12.0, "medium": 2.5, "narrow": 0.5}
_MS_PER_WIDE_ATOM = 5.0  # a wide set outside any repetition (`...........`), when next to others
_MS_PER_STATE_SQ = 1.8e-3  # and the grammar's bounded states together: 10 distinct [0-9]-like {1,128} take 2.7 s
_MS_PER_ARRAY_BOUND_SQ = 1 / 40  # maxItems n costs ~min(n, 128)^2 / 40 ms
_ARRAY_SATURATION = 128
_LITERAL_SQ_PER_MS = 25_000  # alternatives' literals cost sum(len^2) / 25,000 ms
_MS_PER = {"property": 3.0, "branch": 2.0, "integer range": 10.0, "number range": 15.0, "format": 75.0,
           "multipleOf": 5.0, "base": 5.0}
_RANGE_STATES = {"integer range": 10, "number range": 15}  # a range's digits, as bounded states


class Cost:
    """The estimated compile time of one spec, in ms, with what contributes most (for the message)."""

    def __init__(self) -> None:
        self.ms = _MS_PER["base"]
        self.parts: dict[str, float] = {}
        self.seen: set[Any] = set()  # identical constructs compile once (xgrammar shares them)
        self.states = 0  # bounded repetitions' states (each count up to _SATURATION), ranges' digits

    def add(self, ms: float, what: str, key: Any = None) -> None:
        if ms <= 0 or (key is not None and key in self.seen):
            return
        if key is not None:
            self.seen.add(key)
        self.ms += ms
        self.parts[what] = self.parts.get(what, 0.0) + ms

    def repeat(self, width: int, count: int, what: str, key: Any) -> None:
        """A set of `width` characters repeated up to `count` times: a state per count, and the set's own
        (45 distinct [^x]{2} take 1.6 s: the cost per repetition is higher for small counts)."""
        rate = _MS_PER_REPEAT["wide" if width >= WIDE else "medium" if width >= _MEDIUM else "narrow"]
        if key is None or key not in self.seen:
            self.states += min(count, _SATURATION)
        self.add(rate * (min(count, _SATURATION) + 1), what, key)

    def at_least(self, count: int, what: str, key: Any) -> None:
        """A string of at least `count` characters: about half the cost of one of at most `count`."""
        self.add(_MS_PER_REPEAT["wide"] / 2 * min(count, _SATURATION), what, key)

    def wide_atoms(self, n: int, what: str) -> None:
        """`n` wide sets outside any repetition."""
        self.add(_MS_PER_WIDE_ATOM * n, what)

    def literal(self, length: int, what: str) -> None:
        """A literal of `length` characters among alternatives (an enum or const value, a choice, a branch)."""
        self.add(length * length / _LITERAL_SQ_PER_MS, what)

    def array(self, max_items: int, what: str, key: Any) -> None:
        """An array of at most `max_items` items."""
        bound = min(max_items, _ARRAY_SATURATION)
        self.add(bound * bound * _MS_PER_ARRAY_BOUND_SQ, what, key)

    def each(self, item: str, n: int, what: str, key: Any = None) -> None:
        """`n` of a construct of fixed cost: a property, a branch, a format, a multipleOf."""
        self.add(_MS_PER[item] * n, what, key)

    def range(self, kind: str) -> None:
        """A numeric range ("integer range" or "number range"): its digits are bounded states."""
        self.states += _RANGE_STATES[kind]
        self.add(_MS_PER[kind], f"{kind}s")

    def settle(self) -> None:
        """Add the cost that grows with the square of the bounded states; refuse a spec over the budget."""
        self.add(_MS_PER_STATE_SQ * self.states * self.states, "many bounded repetitions together")
        if self.ms <= COMPILE_BUDGET_MS:
            return
        top = sorted(self.parts.items(), key=lambda kv: -kv[1])[:3]
        raise GrammarError(
            f"this would take too long to compile (estimated {self.ms / 1000:.2f} s; at most "
            f"{COMPILE_BUDGET_MS / 1000:.2f} s), mostly for: " + "; ".join(f"{w} (~{ms / 1000:.2f} s)" for w, ms in top)
            + ": loosen or drop these bounds (unbounded repetitions cost little)")
