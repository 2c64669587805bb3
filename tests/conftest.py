"""Shared fixtures: one real redis-server for the session, the real default model, a tiny model."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from infra.redis_server import RedisServer
from shared.settings import Settings

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture
def redis_db(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A flushed database of its own (db 15), for tests that must start from empty."""
    client = redis.Redis(host="127.0.0.1", port=redis_server.port, db=15, decode_responses=True)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@pytest.fixture(scope="session")
def model_path() -> str:
    path = Settings().model_path
    if not (Path(path) / "model.safetensors").exists() and not os.environ.get("MODEL"):
        pytest.fail(f"default model missing at {path}: run `conveyor model pull` (make test does)")
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> str:
    """A randomly initialised Llama of the default model's shape family, tiny, with the real tokenizer."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(model_path) / name).exists():
            shutil.copy(Path(model_path) / name, out / name)
    return str(out)
