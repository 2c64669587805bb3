"""GrammarSpec, structured output's one record: a kind and its canonical source text; and GrammarError, the
refusal that carries a message for the client."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from shared.grammar.limits import MAX_DEPTH

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "tool_calls")


class GrammarError(ValueError):
    """A structured-output request the service refuses, with a message for the client."""


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match: a kind (KINDS) and its canonical source text. The JSON schema keeps its
    properties' order (the output lists them in that order, as OpenAI's does); choices are a JSON list."""

    kind: str
    source: str

    @property
    def key(self) -> str:
        """Its identity (sha256 hex): the compiled grammar's Redis key and cache key."""
        return hashlib.sha256(f"{self.kind}\0{self.source}".encode()).hexdigest()


def canonical(value: Any) -> str:
    """Compact JSON; key order kept (it is the output's property order), non-ASCII as is."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def loads(text: str, what: str) -> Any:
    """A spec's JSON text parsed; GrammarError, starting with `what`, when it is not JSON."""
    try:
        return json.loads(text)
    except RecursionError:
        raise GrammarError(f"{what}: it nests too deep (at most {MAX_DEPTH} levels)") from None
    except ValueError as exc:
        raise GrammarError(f"{what}: {exc}") from None
