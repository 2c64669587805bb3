"""The tokenizer pool's side of tokenize calls (shared/tokenize_calls.py): calls read with the jobs, answered
with the model's own tokenizer and chat template, bad calls answered with an error, never raised."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from tokenizers import Tokenizer

from shared import names
from shared.jobs import new_record
from shared.settings import Settings
from shared.tokenize_calls import REPLY_TTL_S, TokenizeCall, TokenizeReply
from workers.tokenizer.worker import TokenizerWorker

DB = 11
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def settings(redis_server, model_path: str) -> Iterator[Settings]:  # type: ignore[no-untyped-def]
    url = redis_server.url.rsplit("/", 1)[0] + f"/{DB}"
    r = redis.Redis.from_url(url)
    r.flushdb()
    yield Settings(redis_url=url, model=model_path, claim_idle_ms=50, max_model_len=1024)
    r.flushdb()
    r.close()


@pytest.fixture
def worker(settings: Settings) -> TokenizerWorker:
    w = TokenizerWorker(settings)
    w.consumer.ensure_group()
    return w


@pytest.fixture
def r(settings: Settings) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(settings.redis_url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def reference(model_path: str) -> Tokenizer:
    return Tokenizer.from_file(str(Path(model_path) / "tokenizer.json"))


def send(r: redis.Redis, call: TokenizeCall | str, deadline_s: float = 30.0) -> str:
    """A call as the API puts it on the stream (api/routes/tokenize.py `ask`); its id."""
    call_id = names.tokenize_call_id(0, uuid.uuid4().hex)
    wire = call if isinstance(call, str) else call.model_copy(update={"deadline": time.time() + deadline_s}).to_wire()
    r.xadd(names.stream(names.TOKENIZE, 0), {"call_id": call_id, "call": wire})
    return call_id


def answer(worker: TokenizerWorker, r: redis.Redis, *call_ids: str) -> list[TokenizeReply]:
    worker.process(worker.consumer.read(64, 100))
    replies = [r.get(names.tokenize_reply_key(c)) for c in call_ids]
    assert all(replies), replies
    return [TokenizeReply.from_wire(x) for x in replies if x is not None]


def test_a_prompt_is_tokenized_as_the_tokenizers_library_does(worker: TokenizerWorker, r: redis.Redis,
                                                              reference: Tokenizer) -> None:
    text = "The quick brown fox — jumps over 12 lazy dogs. 東京"
    plain, special = answer(worker, r, send(r, TokenizeCall(kind="tokenize", prompt=text)),
                            send(r, TokenizeCall(kind="tokenize", prompt=text, add_special_tokens=False,
                                                 return_token_strs=True)))
    assert plain.tokens == reference.encode(text, add_special_tokens=True).ids
    assert special.tokens == reference.encode(text, add_special_tokens=False).ids
    assert special.token_strs == [reference.id_to_token(i) for i in special.tokens]
    assert plain.token_strs is None


def test_messages_are_tokenized_through_the_chat_template(worker: TokenizerWorker, r: redis.Redis,
                                                          model_path: str) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(model_path)
    with_prompt, without = answer(
        worker, r, send(r, TokenizeCall.model_validate({"kind": "tokenize", "messages": CHAT,
                                                        "add_special_tokens": False})),
        send(r, TokenizeCall.model_validate({"kind": "tokenize", "messages": CHAT, "add_special_tokens": False,
                                             "add_generation_prompt": False})))
    template = {"tokenize": True, "return_dict": False}
    assert with_prompt.tokens == hf.apply_chat_template(CHAT, add_generation_prompt=True, **template)
    assert without.tokens == hf.apply_chat_template(CHAT, add_generation_prompt=False, **template)
    assert with_prompt.tokens != without.tokens


def test_detokenize_round_trips_and_ids_outside_the_vocabulary_are_an_error(
        worker: TokenizerWorker, r: redis.Redis, reference: Tokenizer) -> None:
    text = "Hello, world! Tokens and back again."
    ids = reference.encode(text, add_special_tokens=False).ids
    vocab = reference.get_vocab_size(with_added_tokens=True)
    back, bad, garbage = answer(worker, r, send(r, TokenizeCall(kind="detokenize", tokens=ids)),
                                send(r, TokenizeCall(kind="detokenize", tokens=[1, vocab + 5])),
                                send(r, '{"kind": "detokenize", "tokens": "nope"}'))
    assert back.prompt == text
    assert bad.error is not None and str(vocab + 5) in bad.error and bad.param == "tokens"
    assert garbage.error is not None and garbage.tokens is None
    # the worker goes on: the next call is answered
    (again,) = answer(worker, r, send(r, TokenizeCall(kind="detokenize", tokens=ids[:2])))
    assert again.prompt == reference.decode(ids[:2], skip_special_tokens=False)


def test_a_reply_is_published_and_kept_briefly_and_the_call_is_gone(worker: TokenizerWorker, r: redis.Redis) -> None:
    call_id = names.tokenize_call_id(0, uuid.uuid4().hex)
    pubsub = r.pubsub()
    pubsub.subscribe(names.job_channel(call_id))
    assert pubsub.get_message(timeout=5)["type"] == "subscribe"  # type: ignore[index]
    call = TokenizeCall(kind="tokenize", prompt="hi", deadline=time.time() + 30)
    r.xadd(names.stream(names.TOKENIZE, 0), {"call_id": call_id, "call": call.to_wire()})
    worker.process(worker.consumer.read(64, 100))
    message = pubsub.get_message(timeout=5)
    pubsub.close()
    assert message is not None and TokenizeReply.from_wire(message["data"]).tokens
    assert message["data"] == r.get(names.tokenize_reply_key(call_id))
    assert 0 < r.ttl(names.tokenize_reply_key(call_id)) <= REPLY_TTL_S
    stream = names.stream(names.TOKENIZE, 0)
    assert r.xlen(stream) == 0 and r.xpending(stream, names.TOKENIZER_GROUP)["pending"] == 0


def test_a_call_past_its_deadline_is_dropped_unanswered(worker: TokenizerWorker, r: redis.Redis) -> None:
    late = send(r, TokenizeCall(kind="tokenize", prompt="hi"), deadline_s=-1)
    worker.process(worker.consumer.read(64, 100))
    assert r.get(names.tokenize_reply_key(late)) is None
    assert r.xlen(names.stream(names.TOKENIZE, 0)) == 0


def test_calls_and_jobs_share_a_read_and_the_jobs_go_on(worker: TokenizerWorker, r: redis.Redis) -> None:
    job_id = names.job_id_in(0, "ab" * 16)
    request = json.dumps({"prompt": "Hello there", "max_tokens": 4})
    record = new_record(job_id, "m", request)
    r.hset(names.job_key(job_id), mapping={k: v for k, v in record.items() if k != "request"})
    r.xadd(names.stream(names.JOBS, 0), {"job_id": job_id, "request": request})
    call_id = send(r, TokenizeCall(kind="tokenize", prompt="Hello there"))
    entries = worker.consumer.read(64, 100)
    assert {names.stream_kind(e.stream) for e in entries} == {names.JOBS, names.TOKENIZE}
    worker.process(entries)
    assert r.hexists(names.fair_key(0, "payload"), job_id)
    assert r.xpending(names.stream(names.JOBS, 0), names.TOKENIZER_GROUP)["pending"] == 0
    (reply,) = [TokenizeReply.from_wire(r.get(names.tokenize_reply_key(call_id)) or b"")]
    assert reply.tokens and int(r.hget(names.job_key(job_id), "prompt_tokens") or 0) == len(reply.tokens)
