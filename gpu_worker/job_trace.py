"""A traced job's spans on an inference worker, recorded by its output lane from the times it learns (the
engine's own events arrive with the job's tokens, `StepOutput.timeline`): nothing is traced in the engine loop.

- `conveyor.queue.fair`: queued by the tokenizer pool until this worker took it from the fair queue;
- `conveyor.engine.wait`: taken until the engine scheduled its first prefill chunk (waiting for a slot);
- `conveyor.prefill`: the prompt's chunks (each an event) until its first token;
- `conveyor.decode`: the first token until its last (preemptions as events), with its usage;
- `conveyor.output`: the lane's writes of it to Redis, from its first token's write to its end's.

The first three are recorded at its first token, so a worker that dies later has still told its part; the job's
next worker records its own attempt (`conveyor.job.resumed`) in the same trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shared import tracing
from shared.tracing import Event


@dataclass
class JobTrace:
    carrier: str
    job_id: str
    worker: str
    tokenized_at: float
    admitted_at: float
    resumed: bool
    prompt_tokens: int
    chunks: list[Event] = field(default_factory=list)
    preemptions: list[Event] = field(default_factory=list)
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    writes: int = 0
    reason: str = ""
    output_tokens: int = 0
    error: str = ""

    @property
    def attributes(self) -> dict[str, Any]:
        return {"conveyor.job.id": self.job_id, "conveyor.worker": self.worker, "conveyor.job.resumed": self.resumed}

    def engine_events(self, timeline: list[dict[str, Any]] | None) -> None:
        for e in timeline or ():
            if e["event"] == "preempted":
                self.preemptions.append(("preempted", e["at"], {"conveyor.output_tokens": e["tokens"]}))
            else:
                self.chunks.append(("prefill_chunk", e["at"], {"conveyor.tokens": e["tokens"]}))

    def first_token(self, at: float) -> None:
        """The job's first token here: the waits and the prefill are over."""
        self.first_token_at = at
        scheduled = self.chunks[0][1] if self.chunks else at
        attrs = self.attributes
        if self.tokenized_at:
            tracing.record("conveyor.queue.fair", self.carrier, self.tokenized_at, self.admitted_at, attrs)
        tracing.record("conveyor.engine.wait", self.carrier, self.admitted_at, scheduled, attrs)
        tracing.record("conveyor.prefill", self.carrier, scheduled, at,
                       {**attrs, "gen_ai.usage.input_tokens": self.prompt_tokens,
                        "conveyor.prefill.chunks": len(self.chunks)}, self.chunks)

    def ended(self, at: float, reason: str, output_tokens: int, error: str) -> None:
        """Its last token (or its end without one)."""
        self.last_token_at = at
        self.reason, self.output_tokens, self.error = reason, output_tokens, error

    def written(self, at: float) -> None:
        """Its end is in Redis: decode and output are recorded."""
        start = self.first_token_at or self.last_token_at or at
        attrs = self.attributes
        tracing.record("conveyor.decode", self.carrier, start, self.last_token_at or at,
                       {**attrs, "gen_ai.usage.input_tokens": self.prompt_tokens,
                        "gen_ai.usage.output_tokens": self.output_tokens,
                        "gen_ai.response.finish_reasons": [self.reason], "conveyor.preemptions": len(self.preemptions),
                        "error.type": self.error or None}, self.preemptions)
        tracing.record("conveyor.output", self.carrier, start, at, {**attrs, "conveyor.output.writes": self.writes})
