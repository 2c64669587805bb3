"""Logprobs of tokens that hold part of a character: their `bytes` put the text together again, and legacy
completions' `text_offset` counts each character once (the default model's tokenizer splits CJK characters and
some symbols over two byte-level tokens)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from gpu_worker.token_text import TokenText
from shared.logprobs import Entry, chat_item, completion_logprobs

TEXT = "Hi 🙂 你好 ∑ café"


def entries(model_path: str, text: str) -> list[Entry]:
    """The text's tokens as the output lane records them (gpu_worker/output_lane.py `_entry`), each with itself as
    its one alternative."""
    tokenizer = Tokenizer.from_file(str(Path(model_path) / "tokenizer.json"))
    token_text = TokenText(tokenizer)

    def entry(t: int, *top: list[Entry]) -> Entry:
        text, raw = token_text(t)
        return [t, text, -0.5, *top] + ([raw] if raw is not None else [])

    return [entry(t, [entry(t)]) for t in tokenizer.encode(text).ids]


def test_bytes_of_tokens_that_split_characters_rebuild_the_text(model_path: str) -> None:
    items = [chat_item(e) for e in entries(model_path, TEXT)]
    assert any(i["token"] == "\ufffd" for i in items)  # the tokenizer does split characters here
    assert b"".join(bytes(i["bytes"]) for i in items) == TEXT.encode()
    assert b"".join(bytes(i["top_logprobs"][0]["bytes"]) for i in items) == TEXT.encode()
    assert items[0]["bytes"] == list(b"Hi")  # a whole token: its text's UTF-8


def test_text_offset_counts_a_split_character_once(model_path: str) -> None:
    es = entries(model_path, TEXT)
    lp = completion_logprobs(es, offset=3)
    # each token starts where the character it starts (or goes on with) begins, in the text
    starts = [TEXT.index(ch) for ch in ("H", " 🙂", " 你", "你", "你", "好", "好", " ∑", "∑", " café")]
    assert [len(es), lp["text_offset"]] == [len(starts), [3 + s for s in starts]]
    assert all(set(alts) == {t} for alts, t in zip(lp["top_logprobs"], lp["tokens"]))
