"""The bounds on what the door accepts as structured output: the size of a spec's parts, and the compile time
its cost estimate may reach (cost.py)."""

from __future__ import annotations

MAX_SOURCE_BYTES = 32 * 1024  # a schema, regex or grammar (UTF-8); far beyond any hand-written one
# the tools of one request, each within MAX_SOURCE_BYTES, their descriptions left out (the compile budget below
# bounds them together)
MAX_TOOLS_SOURCE_BYTES = 8 * MAX_SOURCE_BYTES
MAX_DEPTH = 24  # subschemas inside subschemas; also keeps the recursive checks well inside Python's stack
MAX_ENTRIES = 1024  # enum and const values in one schema (20,000 compile in 13 s; the cost grows faster than n)
MAX_REGEX_CHARS = 2000
MAX_REPEAT = 1000  # an explicit count in a regex or grammar ({m,n}); the cost estimate bounds wide ones further
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1000
# the estimated compile time a spec may need: specs at the edge of every kind of cost compiled in 0.9 s at most
# on that machine (~25 MB serialized), 5x inside the tokenizer pool's time bound
COMPILE_BUDGET_MS = 1000
