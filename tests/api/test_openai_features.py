"""The per-token OpenAI features through the whole stack on the default model, with the official client:
logprobs (chat and completions, streamed too, and on /v1/jobs), echo over token-id prompts, several prompts
in one request, n choices, structured output (json_schema, json_object, regex, choice) that always parses, and
speculative decoding (the stack runs SPECULATIVE=ngram) accepting drafts where the model copies text."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import read_events, submit, until, wait

MODEL = "SmolLM2-135M-Instruct"
MSG = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def oai(stack) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def client(stack):  # type: ignore[no-untyped-def]
    with httpx.Client(base_url=stack.url, timeout=120) as c:
        yield c


def test_chat_logprobs_streamed_equal_non_streamed(oai: openai.OpenAI) -> None:
    full = oai.chat.completions.create(model=MODEL, messages=MSG, temperature=0, max_tokens=8, logprobs=True,
                                       top_logprobs=3)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens  # the EOS that ended it too, as vLLM reports it
    assert "".join(c.token for c in content).startswith(full.choices[0].message.content)
    for c in content:
        assert c.logprob <= 0 and len(c.top_logprobs) == 3
        assert c.top_logprobs[0].token == c.token  # greedy: the chosen token is the most likely
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-6)
        assert bytes(c.bytes).decode() == c.token
    streamed = []
    for chunk in oai.chat.completions.create(model=MODEL, messages=MSG, temperature=0, max_tokens=8, logprobs=True,
                                             top_logprobs=3, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content or []
    assert [(c.token, round(c.logprob, 5)) for c in streamed] == [(c.token, round(c.logprob, 5)) for c in content]


def test_completions_echo_over_token_id_prompts(oai: openai.OpenAI, client: httpx.Client) -> None:
    """What lm-eval-harness sends to score choices: token-id prompts, batched, max_tokens 1, logprobs, echo."""
    texts = ["The capital of France is Paris", "The capital of France is London"]
    ids = [oai.completions.create(model=MODEL, prompt=t, max_tokens=1, temperature=0, echo=True, logprobs=0)
           .choices[0].logprobs for t in texts]
    tokens = [[t for t in lp.tokens] for lp in ids]
    body = {"model": MODEL, "prompt": [_ids(client, t) for t in texts], "max_tokens": 1, "temperature": 0,
            "logprobs": 1, "echo": True}
    r = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in r["choices"]] == [0, 1]
    for choice, text, toks in zip(r["choices"], texts, tokens):
        lp = choice["logprobs"]
        assert choice["text"].startswith(text)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["tokens"][: len(toks) - 1] == toks[: len(toks) - 1]
        n_prompt = len(_ids(client, text))
        assert all(v is not None and v <= 0 for v in lp["token_logprobs"][1:n_prompt])
        assert lp["text_offset"][1] == len(lp["tokens"][0])
    paris, london = (sum(c["logprobs"]["token_logprobs"][-2:-1]) for c in r["choices"])
    assert paris > london  # the model knows


def _ids(client: httpx.Client, text: str) -> list[int]:
    """The prompt's token ids, as the server's own tokenizer gives them (echo of a text prompt)."""
    from tokenizers import Tokenizer

    from shared.settings import Settings

    tok = Tokenizer.from_file(Settings().model_path + "/tokenizer.json")
    return tok.encode(text).ids


def test_n_choices_greedy_identical_sampled_distinct(oai: openai.OpenAI) -> None:
    greedy = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0, n=4)
    assert sorted(c.index for c in greedy.choices) == [0, 1, 2, 3]
    assert len({c.text for c in greedy.choices}) == 1
    sampled = oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=16, temperature=1.0, n=4, seed=3)
    assert len({c.message.content for c in sampled.choices}) > 1
    parts: dict[int, str] = {}
    finished = set()
    for chunk in oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=16, temperature=1.0, n=4, seed=3,
                                             stream=True):
        for c in chunk.choices:
            parts[c.index] = parts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1, 2, 3}
    assert [parts[i] for i in range(4)] == [c.message.content for c in sorted(sampled.choices, key=lambda c: c.index)]


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
          "required": ["city", "population"], "additionalProperties": False}


def test_json_schema_output_always_validates(oai: openai.OpenAI) -> None:
    """20 sampled answers at temperature 1 (four requests of n=5, sent together): each parses and validates."""
    import concurrent.futures

    def ask(seed: int) -> list[str]:
        r = oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Describe Paris as JSON."}], max_tokens=80, n=5,
            temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}})
        assert all(c.finish_reason == "stop" for c in r.choices), [c.message.content for c in r.choices]
        return [c.message.content for c in r.choices]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = [a for batch in pool.map(ask, range(11, 15)) for a in batch]
    assert len(answers) == 20
    for a in answers:
        jsonschema.validate(json.loads(a), SCHEMA)


def test_json_object_regex_and_choice(oai: openai.OpenAI) -> None:
    obj = oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=40, temperature=0,
                                      response_format={"type": "json_object"})
    assert obj.choices[0].finish_reason == "stop" and isinstance(json.loads(obj.choices[0].message.content), dict)
    pattern = r"[0-9]{3}-[a-z]{2,5}"
    rx = oai.completions.create(model=MODEL, prompt="A code:", max_tokens=20, temperature=1.0, n=4, seed=5,
                                extra_body={"guided_regex": pattern})
    assert all(re.fullmatch(pattern, c.text) for c in rx.choices)
    pick = oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=10, temperature=1.0, n=4, seed=9,
                                       extra_body={"guided_choice": ["Paris", "London", "Rome"]})
    assert all(c.message.content in ("Paris", "London", "Rome") for c in pick.choices)


def test_a_grammar_that_cannot_finish_ends_at_length(oai: openai.OpenAI) -> None:
    r = oai.completions.create(model=MODEL, prompt="Digits:", max_tokens=5, temperature=0,
                               extra_body={"guided_regex": "[0-9]{50}"})
    assert r.choices[0].finish_reason == "length" and re.fullmatch("[0-9]*", r.choices[0].text)


def test_bad_requests_answer_400(client: httpx.Client) -> None:
    """Every refusal on OpenAI's routes is a 400, as OpenAI's and vLLM's servers answer (the SDK's
    BadRequestError), a field out of its bounds as much as a grammar that does not compile."""
    base = {"model": MODEL, "max_tokens": 2}
    for body, status in [
        ({**base, "prompt": "x", "logprobs": 21}, 400),
        ({**base, "prompt": "x", "n": 9}, 400),
        ({**base, "prompt": [[1, 2], [10**9]]}, 400),  # beyond the vocabulary
        ({**base, "prompt": "x", "logit_bias": {"99999999": 5}}, 400),
        ({**base, "prompt": "x", "guided_regex": "(unclosed"}, 400),
        ({**base, "prompt": "x", "response_format": {"type": "json_schema",
                                                     "json_schema": {"name": "a", "schema": {"type": 5}}}}, 400),
        ({**base, "prompt": ["a"] * 40}, 400),
    ]:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == status, (body, r.text)
        assert r.json()["error"]["message"]


def test_jobs_api_logprobs_in_poll_and_events(client: httpx.Client) -> None:
    job = submit(client, prompt="The sky is", max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                 prompt_logprobs=1)
    done = wait(client, job["id"])
    assert len(done["logprobs"]) == done["usage"]["completion_tokens"]
    assert "".join(e["token"] for e in done["logprobs"]).startswith(done["text"])
    assert done["prompt_logprobs"][0] is None and all(e["logprob"] <= 0 for e in done["prompt_logprobs"][1:])
    events = [e for e in read_events(client, job["id"]) if e.get("event") == "token"]
    streamed = [lp for e in events for lp in json.loads(e["data"]).get("logprobs", [])]
    assert [e["logprob"] for e in streamed] == [e["logprob"] for e in done["logprobs"]]


def test_logprobs_of_characters_split_over_tokens(oai: openai.OpenAI, client: httpx.Client) -> None:
    """A character the tokenizer splits over two tokens (CJK, some symbols) shows U+FFFD in each token's text; their
    `bytes` join into the character again, and legacy `text_offset` points each at the character's start."""
    text = "Hi 🙂 你好 ∑ café"
    done = wait(client, submit(client, prompt=text, max_tokens=1, temperature=0, prompt_logprobs=0)["id"])
    tokens = done["prompt_logprobs"][1:]  # (the first has no logprob, and no entry)
    assert any(t["token"] == "\ufffd" for t in tokens)
    assert b"".join(bytes(t["bytes"]) for t in tokens) == text.encode()[len("Hi"):]
    lp = oai.completions.create(model=MODEL, prompt=text, max_tokens=1, temperature=0, echo=True,
                                logprobs=0).choices[0].logprobs
    assert lp is not None and lp.text_offset is not None
    offsets = lp.text_offset[:10]
    assert offsets == sorted(offsets) and offsets[-1] == text.index(" café"), offsets
    assert [text[o] for o in offsets[3:7]] == ["你", "你", "好", "好"]


def _kept_drafts(client: httpx.Client) -> float:
    fams = text_string_to_metric_families(client.get("/metrics").text)
    return sum(s.value for f in fams if f.name == "conveyor:spec_decode_num_accepted_tokens" for s in f.samples)


def test_copying_text_keeps_drafts_and_the_answer(oai: openai.OpenAI, client: httpx.Client) -> None:
    """A copy of the prompt's text, streamed: the n-gram drafts are kept (several tokens a step), the text is
    the model's greedy answer, and its logprobs come one per token as without speculation."""
    text = "The quick brown fox jumps over the lazy dog, and the lazy dog sleeps. " * 3
    before = _kept_drafts(client)
    msg = [{"role": "user", "content": "Copy the following text word for word:\n\n" + text}]
    chunks = list(oai.chat.completions.create(model=MODEL, messages=msg, temperature=0, max_tokens=48, logprobs=True,
                                              stream=True, stream_options={"include_usage": True}))
    answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert answer.startswith("The quick brown fox jumps over the lazy dog, and the lazy dog sleeps.")
    tokens = sum(len(c.choices[0].logprobs.content or []) for c in chunks if c.choices and c.choices[0].logprobs)
    assert tokens == chunks[-1].usage.completion_tokens
    full = oai.chat.completions.create(model=MODEL, messages=msg, temperature=0, max_tokens=48)
    assert full.choices[0].message.content == answer
    # the workers report their counters with each heartbeat (every second)
    until("kept drafts on /metrics", lambda: _kept_drafts(client) - before >= 10, timeout=10)
