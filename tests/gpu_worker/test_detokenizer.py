"""Incremental detokenizing and stop strings, on the real tokenizer."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from gpu_worker.detokenizer import CONTEXT, HOLD_MAX, WINDOW, Detokenizer, StopMatcher


@pytest.fixture(scope="module")
def tok(model_path: str) -> Tokenizer:
    return Tokenizer.from_file(f"{model_path}/tokenizer.json")


def test_incremental_equals_full_decode(tok: Tokenizer) -> None:
    text = "Héllo, wörld! 你好，世界。 Emoji: 🚀🎉 done."
    ids = tok.encode(text, add_special_tokens=False).ids
    d = Detokenizer(tok, [])
    out = "".join(d.push([i])[0] for i in ids) + d.flush()[0]
    assert out == tok.decode(ids) == text


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=80))
def test_any_text_streams_as_it_decodes_whole(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False).ids
    assume(tok.decode(ids) == text)  # (the byte-level decoder does not give back every code point whole)
    d = Detokenizer(tok, [])
    assert "".join(d.push([i])[0] for i in ids) + d.flush()[0] == text


def test_lone_byte_tokens_come_out_as_replacement_characters_with_bounded_work(tok: Tokenizer) -> None:
    """A run of tokens that are each a character's first byte (logit_bias can force one): tokenizers' DecodeStream
    held every id while the text ended unfinished, decoding the whole run again at each token (a job of 3,000 such
    tokens cost its output lane seconds, and every job beside it waited), and its text never came out."""
    lead = tok.token_to_id("ð")  # byte 0xF0, the first of four
    d = Detokenizer(tok, [])
    out = ""
    for n in range(1, 3001):
        out += d.push([lead])[0]
        assert len(d.stream.ids) <= WINDOW + HOLD_MAX
        assert len(out) > n - HOLD_MAX  # let out as it goes
    assert out + d.flush()[0] == "\ufffd" * 3000 == tok.decode([lead] * 3000)


def test_an_end_inside_a_character_shows_it_as_decode_does(tok: Tokenizer) -> None:
    """max_tokens reached inside a character's bytes: its bytes come out as U+FFFD (they were dropped)."""
    ids = tok.encode("I like 😀", add_special_tokens=False).ids
    d = Detokenizer(tok, [])
    out = "".join(d.push([i])[0] for i in ids[:-1]) + d.flush()[0]
    assert out == tok.decode(ids[:-1]) and out.endswith("\ufffd")


def test_special_tokens_between_text_hold_nothing_back(tok: Tokenizer) -> None:
    """Tokens with no text (special ones, skipped) keep at most CONTEXT ids after HOLD_MAX of them."""
    eos = tok.token_to_id("<|im_end|>")
    d = Detokenizer(tok, [])
    for _ in range(100):
        assert d.push([eos])[0] == ""
        assert len(d.stream.ids) <= CONTEXT + HOLD_MAX
    hello = tok.encode(" Hello", add_special_tokens=False).ids
    assert "".join(d.push([i])[0] for i in hello) + d.flush()[0] == " Hello"


def test_stop_string_split_across_tokens_is_held_back(tok: Tokenizer) -> None:
    text = "The answer is forty-two. END of story"
    ids = tok.encode(text, add_special_tokens=False).ids
    d = Detokenizer(tok, ["END of"])
    streamed, hit = [], False
    for i in ids:
        chunk, hit, used = d.push([i])
        assert used == 1
        streamed.append(chunk)
        assert "END" not in chunk
        if hit:
            break
    assert hit
    assert "".join(streamed) == "The answer is forty-two. "


@pytest.mark.parametrize("pieces,stops,emitted,hit", [
    (["Hel", "lo wor", "ld"], ["world"], "Hello ", "world"),
    (["ab", "c"], ["bd"], "abc", None),
    (["x<", "/s", ">y"], ["</s>"], "x", "</s>"),
    (["a", "b"], [], "ab", None),
    (["tic", "-tac-", "toe"], ["tac", "toe"], "tic-", "tac"),
    (["a", "-toe-tac"], ["tac", "toe"], "a-", "toe"),  # the one that begins first, not the first listed
    (["xab"], ["ab", "a"], "x", "ab"),  # both begin there: the first listed
])
def test_stop_matcher(pieces: list[str], stops: list[str], emitted: str, hit: str | None) -> None:
    m = StopMatcher(stops)
    out, got_hit = "", None
    for p in pieces:
        chunk, got_hit = m.push(p)
        out += chunk
        if got_hit:
            break
    if not got_hit:
        out += m.flush()
    assert (out, got_hit) == (emitted, hit)


def test_nothing_streamed_is_retracted() -> None:
    m = StopMatcher(["STOP"])
    assert m.push("ST") == ("", None)   # might be the start of STOP: held
    assert m.push("AR") == ("STAR", None)  # it was not: released
    assert m.push("S") == ("", None)
    assert m.push("TOP") == ("", "STOP")


def test_resume_restores_held_text(tok: Tokenizer) -> None:
    ids = tok.encode("Hello world and more", add_special_tokens=False).ids
    d = Detokenizer(tok, [])
    d.resume(ids[:2], "Hello")
    rest, _, _ = d.push(ids[2:])
    assert "Hello" + rest + d.matcher.flush() == "Hello world and more"


def test_a_step_of_several_tokens_ends_where_one_at_a_time_would(tok: Tokenizer) -> None:
    """A speculative step hands several tokens at once: the text, and the tokens that count, end at the token that
    completed the stop string, as steps of one token each would."""
    text = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(text, add_special_tokens=False).ids
    one = Detokenizer(tok, ["fox"])
    n = next(n for n, i in enumerate(ids, 1) if one.push([i])[1])  # the token that completes "fox"
    whole, hit_whole, used = Detokenizer(tok, ["fox"]).push(ids)
    assert hit_whole == "fox" and used == n < len(ids) and whole == "The quick brown "


def test_no_stop_string_ends_the_text_before_min_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("a b a b a b", add_special_tokens=False).ids
    out, hit, used = Detokenizer(tok, ["b"], min_tokens=4).push(ids)
    assert hit == "b" and used == 4 and out == "a b a "  # (the 2nd " b" was let through)
    out, hit, used = Detokenizer(tok, ["b"]).push(ids)
    assert hit == "b" and used == 2 and out == "a "


def test_a_stop_string_that_begins_before_min_tokens_and_ends_after_ends_the_text(tok: Tokenizer) -> None:
    """vLLM's meaning: from the min_tokens-th token on, a stop string that ends in the new text ends it, wherever it
    began; one that ended before is let through. The text that might begin one is held back, as always."""
    ids = tok.encode(" girl named Emily who loved reading. But", add_special_tokens=False).ids
    for stop, min_tokens in (("named Emily who", 3), ("named Emily", 3), ("named Emily", 2)):
        d = Detokenizer(tok, [stop], min_tokens=min_tokens)
        streamed, hit, used = [], None, 0
        for i in ids:
            chunk, hit, used = d.push([i])
            streamed.append(chunk)
            if hit:
                break
        assert hit == stop and "".join(streamed) == " girl ", (stop, min_tokens, streamed)
    # ended before the min_tokens-th token: let through (the text holds it whole)
    d = Detokenizer(tok, ["named"], min_tokens=4)
    out, hit, _ = d.push(ids)
    assert hit is None and (out + d.matcher.flush()).startswith(" girl named Emily")


def test_include_stop_str_in_output_keeps_the_stop_string_and_drops_what_follows(tok: Tokenizer) -> None:
    """vLLM's `include_stop_str_in_output`: the text ends with the stop string that ended it (held back like any
    text that might begin one, then emitted); what its last token carried past it is not."""
    ids = tok.encode("The answer is forty-two. END of story", add_special_tokens=False).ids
    d = Detokenizer(tok, ["END o"], include_stop=True)
    streamed, hit = [], None
    for i in ids:
        chunk, hit, _ = d.push([i])
        streamed.append(chunk)
        if hit:
            break
    assert hit == "END o" and "".join(streamed) == "The answer is forty-two. END o"


def test_special_tokens_keep_the_context_and_hold_nothing(tok: Tokenizer) -> None:
    """Skipped special tokens between characters: they neither count towards HOLD_MAX (a character's first byte
    after 7 of them came out as U+FFFD) nor push the text's context out."""
    eos = tok.token_to_id("<|im_end|>")
    ids = tok.encode("Hi! 世界 done", add_special_tokens=False).ids
    for k in (3, 8, 20):
        for at in range(1, len(ids)):
            d = Detokenizer(tok, [])
            mixed = ids[:at] + [eos] * k + ids[at:]
            assert "".join(d.push([i])[0] for i in mixed) + d.flush()[0] == "Hi! 世界 done", (k, at)


def test_a_stop_string_completed_by_the_text_let_out_at_the_end_stops_it(tok: Tokenizer) -> None:
    """The text held back for an unfinished character, let out as the job ends, goes through the stop strings too."""
    lead = tok.token_to_id("ð")  # a character's first byte: held back until the end
    say = tok.encode("Say", add_special_tokens=False).ids
    d = Detokenizer(tok, ["y\ufffd"])
    emitted = "".join(d.push([i])[0] for i in say + [lead])
    held, hit = d.flush()
    assert hit == "y\ufffd" and "\ufffd" not in emitted + held and (emitted + held).endswith("Sa")
