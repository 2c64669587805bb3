"""Each token's own text, as logprobs report it: a byte-level BPE token's bytes decoded as UTF-8 (a token
that ends inside a character shows U+FFFD there, as vLLM's do), else the tokenizer's decoding of it alone."""

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
    """Token id -> text, cached (at most the vocabulary's size)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.byte_level = isinstance(tokenizer.decoder, ByteLevel)
        self._bytes = _byte_decoder()
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._text(token_id)
        return text

    def _text(self, token_id: int) -> str:
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return ""
        if self.byte_level and all(c in self._bytes for c in piece):
            return bytes(self._bytes[c] for c in piece).decode("utf-8", errors="replace")
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
