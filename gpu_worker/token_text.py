"""Each token's own text, as logprobs report it: a byte-level BPE token's bytes decoded as UTF-8 (a token
that ends inside a character shows U+FFFD there, as vLLM's do), else the tokenizer's decoding of it alone; and, for
a token whose text is not its bytes (a part of a character), the bytes themselves, which OpenAI's `bytes` carry so
that a client can put such characters together again."""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import ByteLevel


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character that stands for each byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = list(kept), 0
    for b in range(256):
        if b not in kept:
            kept.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(kept, chars)}


class TokenText:
    """Token id -> (text, its bytes when they are not the text's UTF-8, else None), cached (at most the vocabulary's
    size)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.byte_level = isinstance(tokenizer.decoder, ByteLevel)
        self._bytes = _byte_decoder()
        self._cache: dict[int, tuple[str, list[int] | None]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int] | None]:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._text(token_id)
        return found

    def _text(self, token_id: int) -> tuple[str, list[int] | None]:
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return "", None
        if self.byte_level and all(c in self._bytes for c in piece):
            raw = bytes(self._bytes[c] for c in piece)
            text = raw.decode("utf-8", errors="replace")
            return text, None if text.encode() == raw else list(raw)
        return self.tokenizer.decode([token_id], skip_special_tokens=False), None
