"""Shared fixtures: one real redis-server for the session, the real default model, a tiny model."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from infra.redis_server import RedisServer
from shared.lifecycle import preexec_die_with_parent
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
    client = redis.Redis.from_url(redis_server.url.rsplit("/", 1)[0] + "/15", decode_responses=True)
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


class Stack:
    """The whole stack under the real supervisor (`conveyor up`), on the session's Redis."""

    def __init__(self, url: str, redis_url: str, proc: subprocess.Popen[bytes], env: dict[str, str]) -> None:
        self.url, self.redis_url, self.proc, self.env = url, redis_url, proc, env

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url, decode_responses=True)

    def worker_pids(self, pool: str) -> list[int]:
        from shared.heartbeat import live_workers

        return [w["pid"] for w in live_workers(self.redis(), pool)]


def start_stack(tmp: Path, redis_url: str, model: str, extra: dict[str, str] | None = None,
                args: list[str] | None = None, ready_path: str = "/readyz", autoscale: bool = False) -> Stack:
    import subprocess
    import sys
    import time
    import urllib.request

    from infra.redis_server import free_port

    port = free_port()
    env = dict(os.environ)
    env.update({
        "REDIS_URL": redis_url, "PORT": str(port), "HOST": "127.0.0.1", "MODEL": model,
        "CLAIM_IDLE_MS": "3000", "REFRESH_S": "0.5", "HEARTBEAT_S": "1", "MAX_MODEL_LEN": "1024",
        "MAX_TOKENS_CAP": "1000", "DRAIN_GRACE_S": "10", "LOG_LEVEL": "WARNING", "CONVEYOR_CACHE": str(tmp),
        "WEBHOOK_ALLOW_PRIVATE": "1",  # the tests' webhook receivers listen on 127.0.0.1
    })
    env.update(extra or {})
    log = open(tmp / "stack.log", "ab")
    flags = [] if autoscale else ["--no-autoscale"]
    proc = subprocess.Popen([sys.executable, "-m", "infra.cli", "up", *flags, *(args or [])],
                            env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=preexec_die_with_parent())  # a killed test run leaves no stack behind
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"stack exited early; see {tmp / 'stack.log'}")
        try:
            with urllib.request.urlopen(url + ready_path, timeout=2) as resp:
                if resp.status == 200:
                    return Stack(url, redis_url, proc, env)
        except OSError:
            time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("stack did not become ready")


def stop_stack(stack: Stack) -> None:
    import signal
    import subprocess

    stack.proc.send_signal(signal.SIGTERM)
    try:
        stack.proc.wait(60)
    except subprocess.TimeoutExpired:
        stack.proc.kill()


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, model_path: str) -> Iterator[Stack]:
    """The real default model behind the full stack (db 0 of the session's Redis)."""
    s = start_stack(tmp_path_factory.mktemp("stack"), redis_server.url, model_path)
    yield s
    stop_stack(s)
