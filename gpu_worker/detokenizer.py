"""Incremental detokenizing with stop strings, per job.

Text that might be the beginning of a stop string is held back until it is clearly not;
so nothing streamed is ever retracted, and a stop string never reaches the client.
"""

from __future__ import annotations

from tokenizers import Tokenizer

HOLD_MAX = 8  # tokens an unfinished character may hold its text back: then it is let out as U+FFFD, as decode shows it
CONTEXT = 4  # ids kept before the text not yet let out, for decoders that read a token by its neighbours
WINDOW = 8  # ids decoded at most before the kept ones are cut back to CONTEXT


class TextStream:
    """A job's token ids in, its text out, a piece at a time: each new id decodes the few before it with it, and the
    new characters are let out, except an unfinished one (a character's bytes split over tokens), held back for up
    to HOLD_MAX tokens. Unlike tokenizers' DecodeStream, which holds every id while its text ends unfinished (a run
    of lone byte tokens cost each step the decoding of the whole run, and its text never came out), the work per
    token is bounded, and `rest` lets out what is held when the job ends."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        # special tokens, which decoding skips: never among the ids, so that they neither count as held text nor
        # push out the context a decoder reads a token by (a SentencePiece word's leading space)
        self.skipped = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        self.ids: list[int] = []
        self.read = 0  # ids[:read] are let out: context only
        self.prefix = ""  # their text

    def step(self, token_id: int) -> str:
        if token_id in self.skipped:
            return ""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        held = len(self.ids) - self.read
        if len(text) <= len(self.prefix) or (text.endswith("\ufffd") and held < HOLD_MAX):
            if held >= HOLD_MAX:  # nothing but tokens with no text
                self._cut()
            return ""
        piece = text[len(self.prefix):]
        if len(self.ids) > WINDOW:
            self._cut()
        else:
            self.read, self.prefix = len(self.ids), text
        return piece

    def rest(self) -> str:
        """The text held back (an unfinished character, as U+FFFD), let out now: the job has ended."""
        if len(self.ids) == self.read:
            return ""
        text, prefix = self.tokenizer.decode(self.ids, skip_special_tokens=True), self.prefix
        self._cut()
        return text[len(prefix):]

    def _cut(self) -> None:
        del self.ids[:max(0, len(self.ids) - CONTEXT)]
        self.read = len(self.ids)
        self.prefix = self.tokenizer.decode(self.ids, skip_special_tokens=True)


class StopMatcher:
    def __init__(self, stops: list[str], include: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include = include  # the stop string hit is emitted too (what follows it in its token is not)
        self.pending = ""
        # per stop string, by character, the lengths k of its proper prefixes that end in it, longest first: the text
        # held back is the longest such prefix the text ends with, and only those ending in its last character can
        # (a check per token in time with few candidates, not with the stop strings' lengths)
        self._ends: list[tuple[str, dict[str, list[int]]]] = []
        for stop in self.stops:
            ends: dict[str, list[int]] = {}
            for k in range(len(stop) - 1, 0, -1):
                ends.setdefault(stop[k - 1], []).append(k)
            self._ends.append((stop, ends))

    def push(self, text: str, check: bool = True) -> tuple[str, str | None]:
        """Add generated text; return (text safe to emit now, the stop string hit: the one that begins first,
        the first listed of those that begin there; None while none is). A hit must end in `text` (one that ended
        before was let through: below min_tokens); `check` False: none counts yet, but what might begin one is still
        held back."""
        held = len(self.pending)
        buf = self.pending + text
        if not self.stops:
            self.pending = ""
            return buf, None
        found = ((n, buf.find(s, max(0, held - len(s) + 1))) for n, s in enumerate(self.stops)) if check else ()
        hits = [(i, n) for n, i in found if i >= 0]
        if hits:
            self.pending = ""
            at, n = min(hits)
            return buf[:at + len(self.stops[n]) * self.include], self.stops[n]
        hold = 0
        last = buf[-1:]
        for s, ends in self._ends:
            for k in ends.get(last, ()):
                if k <= len(buf) and buf.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        self.pending = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], None

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Detokenizer:
    """Token ids in, safe-to-stream text out. Stop strings are looked for token by token, as a step of one token
    would show them: a speculative step's several tokens end the text (and are counted) where one at a time
    would. Before `min_tokens` tokens, no stop string ends it; from the min_tokens-th on, one ending there does,
    wherever it began (vLLM's meaning: its check looks back a stop string's length into the text before)."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str], min_tokens: int = 0, include_stop: bool = False) -> None:
        self.stream = TextStream(tokenizer)
        self.matcher = StopMatcher(stops, include_stop)
        self.min_tokens = min_tokens
        self.generated = 0  # tokens decoded so far

    def decode(self, token_ids: list[int]) -> str:
        return "".join(self.stream.step(t) for t in token_ids)

    def push(self, token_ids: list[int]) -> tuple[str, str | None, int]:
        """A step's new tokens: (text safe to emit now, the stop string hit (None: none), how many of the tokens
        count: all of them, or those up to the one that completed the stop string)."""
        out = []
        for n, t in enumerate(token_ids, 1):
            piece = self.stream.step(t)
            self.generated += 1
            emit, hit = self.matcher.push(piece, check=self.generated >= self.min_tokens)
            out.append(emit)
            if hit is not None:
                return "".join(out), hit, n
        return "".join(out), None, len(token_ids)

    def flush(self) -> tuple[str, str | None]:
        """At the job's end: (the text held back, for an unfinished character or a possible stop string, the stop
        string that text completes: None, none; the text then ends before it, as `push`'s)."""
        emit, hit = self.matcher.push(self.stream.rest(), check=self.generated >= self.min_tokens)
        return (emit, hit) if hit is not None else (emit + self.matcher.flush(), None)

    def resume(self, token_ids: list[int], emitted: str) -> None:
        """Rebuild state for a job continued from `token_ids` of which `emitted` was already streamed."""
        text = self.decode(token_ids)
        self.generated = len(token_ids)
        self.matcher.pending = text[len(emitted) :] if text.startswith(emitted) else ""
