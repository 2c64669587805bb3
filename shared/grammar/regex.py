"""The door's checks on a regex: short, valid, within xgrammar's dialect, and its cost added to the estimate.

The pattern is read in the parsed form of CPython's private parser (`re._parser`, with `re._constants`), which
is what tells a wide set from a narrow one and lookaround from a group. Where that parser is missing, or no
longer has the shape read here (checked on a probe at import, and any surprise while walking a pattern), the
regex is checked from its source alone (`_check_source`): its validity, flags and named groups through `re`'s
public API, and its cost bounded from above, never below, by one rule: every explicit count `{m,n}` in the
source costs as a repetition of a wide set (the most costly kind, none shared), every `.`, `[`, `\\` and `|`
as a wide set (129 one-character alternatives parse as one), and a source with a `|` as one long alternative.
Constructs outside xgrammar's dialect that only the parsed form shows (lookaround, backreferences, \\b, scoped
flags) are then refused by the compiler itself, which fails the request's job with its message.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

from shared.grammar.cost import WIDE, Cost
from shared.grammar.limits import MAX_REGEX_CHARS, MAX_REPEAT
from shared.grammar.spec import GrammarError

_ALLOWED_FLAGS = re.UNICODE  # Python's default for a str pattern
# a parsed form that no longer has the shape read here shows as one of these while it is walked
_SHAPE_ERRORS = (AttributeError, TypeError, ValueError, KeyError, IndexError)

sre: Any = None  # re._constants
sre_parse: Any = None  # re._parser
try:  # the parsed form of a regex: stable since Python 3.11
    sre, sre_parse = importlib.import_module("re._constants"), importlib.import_module("re._parser")

    # what Python's `re` accepts and xgrammar's regex dialect does not (xgrammar would refuse it or, for \A and
    # \Z, read a letter), found in the parsed pattern
    _UNSUPPORTED_AT = {sre.AT_BOUNDARY: r"word boundaries (\b)", sre.AT_NON_BOUNDARY: r"word boundaries (\B)",
                       sre.AT_BEGINNING_STRING: r"\A (the whole output matches anyway)",
                       sre.AT_END_STRING: r"\Z (the whole output matches anyway)"}
    _UNSUPPORTED_OPS = {sre.ASSERT: "lookahead and lookbehind", sre.ASSERT_NOT: "lookahead and lookbehind",
                        sre.GROUPREF: "backreferences", sre.GROUPREF_EXISTS: "conditional groups",
                        sre.ATOMIC_GROUP: "atomic groups (?>...)", sre.POSSESSIVE_REPEAT: "possessive repetitions"}
    _CATEGORY_WIDTH = {sre.CATEGORY_DIGIT: 10, sre.CATEGORY_SPACE: 6, sre.CATEGORY_WORD: 63}
    _REPEATS = (sre.MAX_REPEAT, sre.MIN_REPEAT)
    _WIDE_ATOMS = (sre.NOT_LITERAL, sre.ANY, sre.IN)
except (ImportError, AttributeError):
    sre_parse = None


def _parser() -> Any:
    """`re._parser.parse` where it reads `a{2,3}` as [(MAX_REPEAT, (2, 3, [(LITERAL, 97)]))] and exposes the
    pattern's flags and named groups; None otherwise (the source alone is read)."""
    if sre_parse is None:
        return None
    try:
        parsed = sre_parse.parse("a{2,3}")
        [(op, (lo, hi, sub))] = list(parsed)
        fits = (op is sre.MAX_REPEAT and (lo, hi) == (2, 3) and list(sub) == [(sre.LITERAL, 97)]
                and isinstance(parsed.state.flags, int) and isinstance(parsed.state.groupdict, dict))
    except (*_SHAPE_ERRORS, re.error):
        return None
    return sre_parse.parse if fits else None


PARSE = _parser()  # None: the regex is checked from its source


def check_regex(rx: str, cost: Cost, what: str) -> None:
    """A regex must be short, valid (Python's `re` parses it, for a precise message), within xgrammar's dialect
    (no lookaround, backreferences, \\b, inline flags or named groups; note that xgrammar's `.` also matches a
    newline, and its \\d, \\w, \\s are ASCII), and not too costly to compile."""
    if len(rx) > MAX_REGEX_CHARS:
        raise GrammarError(f"{what} is {len(rx)} characters; at most {MAX_REGEX_CHARS}")
    if PARSE is not None:
        try:
            _check_parsed(PARSE, rx, cost, what)
            return
        except GrammarError:
            raise
        except _SHAPE_ERRORS:  # the parser changed shape: what it added to `cost` stays (the estimate errs high)
            pass
    _check_source(rx, cost, what)


def _check_parsed(parse: Any, rx: str, cost: Cost, what: str) -> None:
    try:
        parsed = parse(rx)
    except (re.error, OverflowError) as exc:  # a count past the parser's integers overflows
        raise GrammarError(f"{what} is invalid: {exc}") from None
    except RecursionError:
        raise GrammarError(f"{what} nests too deep") from None
    _refuse_flags_and_names(parsed.state.flags, parsed.state.groupdict, what)
    try:
        _walk(parsed, cost, what, False)
    except RecursionError:
        raise GrammarError(f"{what} nests too deep") from None


def _refuse_flags_and_names(flags: int, groups: dict[str, int], what: str) -> None:
    if flags & ~_ALLOWED_FLAGS:
        raise GrammarError(f"{what} sets flags (such as (?i)), which structured output does not support")
    if groups:
        raise GrammarError(f"{what} names a group ((?P<name>...)), which structured output does not support: "
                           "use (?:...) or (...)")


def _walk(items: Any, cost: Cost, what: str, repeated: bool) -> int:
    """Check a parsed pattern's items and add their cost (an atom inside a repetition is the repetition's); the
    width (characters) of its widest atom."""
    width = 0
    for op, av in items:
        if op in _UNSUPPORTED_OPS:
            raise GrammarError(f"{what} uses {_UNSUPPORTED_OPS[op]}, which structured output does not support")
        if op is sre.AT:
            if av in _UNSUPPORTED_AT:
                raise GrammarError(f"{what} uses {_UNSUPPORTED_AT[av]}, which structured output does not support")
            continue
        w = _item(op, av, cost, what, repeated)
        if w >= WIDE and not repeated and op in _WIDE_ATOMS:
            cost.wide_atoms(1, f"wide character sets in {what}")
        width = max(width, w)
    return width


def _item(op: Any, av: Any, cost: Cost, what: str, repeated: bool) -> int:
    """One parsed item's width, its repetitions and alternatives walked and costed."""
    if op is sre.LITERAL:
        return 1
    if op in (sre.NOT_LITERAL, sre.ANY):
        return WIDE
    if op is sre.IN:
        return _set_width(av)
    if op in _REPEATS:
        lo, hi, sub = av
        w = _walk(sub, cost, what, True)
        count = lo if hi == sre.MAXREPEAT else hi
        if count > MAX_REPEAT:
            raise GrammarError(f"{what} repeats {count} times; at most {MAX_REPEAT}")
        if count > 1:
            cost.repeat(w, count, f"{{{lo},{'' if hi == sre.MAXREPEAT else hi}}} in {what}", (repr(sub), lo, hi))
        return w
    if op is sre.SUBPATTERN:
        _, add_flags, del_flags, sub = av
        if add_flags or del_flags:
            raise GrammarError(f"{what} sets flags (such as (?i:...)), which structured output does not support")
        return _walk(sub, cost, what, repeated)
    if op is sre.BRANCH:
        w = 0
        for alt in av[1]:
            w = max(w, _walk(alt, cost, what, repeated))
            cost.literal(sum(1 for o, _ in alt if o is sre.LITERAL), f"long alternatives in {what}")
        return w
    return WIDE  # anything else Python parses: counted as wide, to be safe


def _set_width(items: Any) -> int:
    """How many characters a [...] set (or \\d, \\w, \\s) holds, roughly: a negated set counts as wide."""
    n = 0
    for op, av in items:
        if op is sre.NEGATE:
            return WIDE
        if op is sre.LITERAL:
            n += 1
        elif op is sre.RANGE:
            n += av[1] - av[0] + 1
        elif op is sre.CATEGORY:
            n += _CATEGORY_WIDTH.get(av, WIDE)
        else:
            n += WIDE
    return n


# --- from the source alone (no parsed form) -------------------------------------------------------------------

_COUNT = re.compile(r"\{(\d*)(?:,(\d*))?\}")  # {m}, {m,}, {m,n}, {,n} (`{}` and `{,}` count nothing)


def _check_source(rx: str, cost: Cost, what: str) -> None:
    """The checks without the parsed form: validity, flags and named groups from the compiled pattern, and the
    cost by the module's rule, above what the parsed form would estimate."""
    try:
        compiled = re.compile(rx)
    except (re.error, OverflowError) as exc:
        raise GrammarError(f"{what} is invalid: {exc}") from None
    except RecursionError:
        raise GrammarError(f"{what} nests too deep") from None
    _refuse_flags_and_names(compiled.flags, dict(compiled.groupindex), what)
    for m in _COUNT.finditer(rx):
        lo, hi = m.group(1), m.group(2)
        count = int(hi) if hi else int(lo) if lo else 0
        if count > MAX_REPEAT:
            raise GrammarError(f"{what} repeats {count} times; at most {MAX_REPEAT}")
        if count > 1:
            cost.repeat(WIDE, count, f"{m.group(0)} in {what}", None)
    cost.wide_atoms(sum(rx.count(c) for c in ".[\\|"), f"wide character sets in {what}")
    if "|" in rx:
        cost.literal(len(rx), f"long alternatives in {what}")
