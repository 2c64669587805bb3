"""Redis's refusals of a write, as the exception classes every caller waits out (shared.redis_client's
`UNAVAILABLE`): nothing of the refused command or script was written, and the same write succeeds once Redis
accepts writes again.

- A Redis at its `maxmemory` (noeviction) answers `OOM`: redis-py's `OutOfMemoryError`.
- A master with too few replicas for `min-replicas-to-write` answers `NOREPLICAS`, and one whose last save failed
  (a full disk: `stop-writes-on-bgsave-error`, or an append-only file it cannot write) answers `MISCONF`. redis-py
  has no class for either: they are `WritesRefusedError` here, registered in redis-py's table of error replies
  (`BaseParser.EXCEPTION_CLASSES`, by the reply's first word) for every client of the process, any parser.
- A script refused at its first write answers with its own error, which names the refusal only in its text:
  `refused` gives it the command's class.
"""

from __future__ import annotations

from redis._parsers.base import BaseParser
from redis.exceptions import OutOfMemoryError, ResponseError


class WritesRefusedError(ResponseError):
    """Redis refuses writes for a state of its own, for now: too few replicas (`NOREPLICAS`) or a failing save
    (`MISCONF`)."""


WRITE_REFUSALS = ("NOREPLICAS", "MISCONF")
for _code in WRITE_REFUSALS:
    BaseParser.EXCEPTION_CLASSES.setdefault(_code, WritesRefusedError)


def refused(exc: ResponseError) -> ResponseError:
    """A script's error as the command's would be, where it is a refusal of its write; else `exc`."""
    if type(exc) is not ResponseError:  # already a class of its own (a command's refusal among them)
        return exc
    text = str(exc)
    if "OOM command not allowed" in text:
        return OutOfMemoryError(text)
    if any(f"-{code} " in text or text.startswith(f"{code} ") for code in WRITE_REFUSALS):
        return WritesRefusedError(text)
    return exc
