"""The door's checks on a list of choices: 1 to MAX_CHOICES non-empty strings, their lengths costed."""

from __future__ import annotations

from shared.grammar.cost import Cost
from shared.grammar.limits import MAX_CHOICE_CHARS, MAX_CHOICES
from shared.grammar.spec import GrammarError, loads


def check_choices(source: str, cost: Cost) -> None:
    choices = loads(source, "the choices are not a JSON list")
    if not isinstance(choices, list) or not 1 <= len(choices) <= MAX_CHOICES:
        raise GrammarError(f"give 1 to {MAX_CHOICES} choices")
    for c in choices:
        if not isinstance(c, str) or not 0 < len(c) <= MAX_CHOICE_CHARS:
            raise GrammarError(f"each choice must be a non-empty string of at most {MAX_CHOICE_CHARS} characters")
        cost.literal(len(c), "long choices")
