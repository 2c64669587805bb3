"""The command line: a worker started without its model says what to do instead of a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


@pytest.mark.parametrize("pool", ["tokenizer", "inference"])
def test_worker_without_a_model_says_how_to_get_one(pool: str, tmp_path: Path) -> None:
    env = {**os.environ, "MODEL": str(tmp_path), "REDIS_URL": "redis://127.0.0.1:1/0"}
    out = subprocess.run([sys.executable, "-m", "infra.cli", pool], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1
    assert f"no model at {tmp_path}" in out.stderr and "conveyor model pull" in out.stderr
    assert "Traceback" not in out.stderr


def test_commands_beside_a_stack_take_its_partitions_and_models(redis_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`conveyor up --redis-cluster 3` gives its stack 12 partitions and `--model` its models, in its own
    environment: `conveyor keys` and `conveyor status` run from another shell read them from the stack's connection
    file, so a key lands in the partition where the stack's API looks for it and status shows every model's pool."""
    import json

    import redis

    from shared import names

    url = redis_server.url.rsplit("/", 1)[0] + "/4"
    r = redis.Redis.from_url(url)
    r.flushdb()
    (tmp_path / "redis").mkdir()
    (tmp_path / "redis" / "connection.json").write_text(json.dumps(
        {"url": url, "env": {"REDIS_PARTITIONS": "12", "MODELS": f"a={tmp_path},b={tmp_path}"}}))
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "REDIS_PARTITIONS", "MODELS")}
    env["CONVEYOR_CACHE"] = str(tmp_path)
    try:
        for argv in (["keys", "create", "team-x"], ["status"]):
            out = subprocess.run([sys.executable, "-m", "infra.cli", *argv], cwd=ROOT, env=env, capture_output=True,
                                 text=True, timeout=120)
            assert out.returncode == 0, out.stderr
        assert "inference:b" in out.stdout
        with names.partitions_as(12):
            assert r.exists(names.tenant_key("team-x"))
    finally:
        r.flushdb()


def test_up_refuses_a_model_without_its_weights(tmp_path: Path, model_path: str) -> None:
    """`conveyor up` with a model whose directory lacks its weights says which, before anything starts: its jobs
    would otherwise wait for good while its workers fail to load, again and again."""
    import shutil

    from tests.helpers import conveyor

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(Path(model_path) / name, bare / name)
    env = {"MODELS": f"a={model_path},b={bare}", "CONVEYOR_CACHE": str(tmp_path / "cache"), "REDIS_URL": ""}
    out = conveyor("up", "--no-autoscale", env=env)
    assert out.returncode == 1 and f"MODELS: b: no model at {bare} (weights" in out.stderr, out.stderr


def test_up_refuses_an_architecture_the_engine_does_not_run(tmp_path: Path, tiny_model_dir: str) -> None:
    """A model whose config.json names an architecture the engine does not compute (gemma) is refused by `conveyor
    up` in one line, before anything starts (a worker would refuse it too: tests/gpu_worker/engine/test_engine.py)."""
    import json
    import shutil

    from tests.helpers import conveyor

    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "model_type": "gemma"}))
    out = conveyor("up", "--no-autoscale", env={"MODEL": str(other), "CONVEYOR_CACHE": str(tmp_path / "cache"),
                                                "REDIS_URL": ""})
    assert out.returncode == 1 and f"the model at {other} is a 'gemma'" in out.stderr, out.stderr
    assert "the engine runs llama, mistral, qwen2, qwen3" in out.stderr and "Traceback" not in out.stderr


def test_a_model_that_may_scale_to_zero_runs_one_worker_without_the_autoscaler(model_path: str) -> None:
    """`conveyor up --no-autoscale` and a model whose MODELS entry says min_replicas 0: nothing would ever scale
    it up, so its pool runs one worker (its jobs would otherwise wait for good); with the autoscaler it starts at 0."""
    import json

    from infra.supervisor import _pools
    from shared.settings import Settings

    models = json.dumps([{"name": "a", "path": model_path}, {"name": "b", "path": model_path, "min_replicas": 0}])
    for autoscale, want in ((False, (1, 1)), (True, (0, 0))):
        pools = _pools(Settings(MODELS=models), {}, (), 1, 1, autoscale, celery=False, traces_port=0)  # type: ignore[call-arg]
        b = pools.workers["inference:b"]
        assert (b.target, b.min_size) == want, autoscale
    # `--inference 0` is the operator's: without the autoscaler no worker here (they run apart), and it says so
    for autoscale in (False, True):
        pools = _pools(Settings(MODEL=model_path), {}, (), 1, 0, autoscale, celery=False, traces_port=0)
        [only] = [p for name, p in pools.workers.items() if name.startswith("inference")]
        assert (only.target, only.min_size) == (0, 0), autoscale


def test_a_sigterm_swallowed_while_starting_still_ends_the_process() -> None:
    """The stop raised in a finalizer (as in a weakref callback of an import's lock) is printed and ignored by
    Python; the process ends all the same, STOP_FALLBACK_S later, rather than going on to start (a pod's one
    SIGTERM would otherwise be lost)."""
    from infra.cli import STOP_FALLBACK_S

    code = ("import os, signal, time\n"
            "from infra.cli import _stop_while_starting\n"
            "signal.signal(signal.SIGTERM, _stop_while_starting)\n"
            "class Finalized:\n"
            "    def __del__(self):\n"
            "        os.kill(os.getpid(), signal.SIGTERM)\n"
            "        time.sleep(0.2)  # the handler runs here, inside the finalizer\n"
            "Finalized()\n"
            "print('went on', flush=True)\n"
            "time.sleep(60)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 143, (out.returncode, out.stderr)
    assert "Exception ignored" in out.stderr and "went on" in out.stdout  # the case this covers did occur
    assert STOP_FALLBACK_S < 10


@pytest.mark.parametrize(("setting", "value"), [("MAX_NUM_SEQS", "0"), ("PORT", "abc"), ("DTYPE", "bogus"),
                                                ("KV_CACHE_MB", "-1"), ("DEVICE", "tpu")])
def test_an_invalid_setting_is_one_line_naming_it(setting: str, value: str, tmp_path: Path) -> None:
    """Not a pydantic traceback, nor (MAX_NUM_SEQS=0) a stack that says it is up and never runs a job."""
    env = {**os.environ, setting: value, "CONVEYOR_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "infra.cli", "up"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("invalid settings:") and f"{setting}={value!r}" in out.stderr, out.stderr


def test_up_refuses_a_port_another_server_listens_on(tmp_path: Path, model_path: str) -> None:
    """Another server on PORT: said at once. Before, the API exited and restarted for ever, and `conveyor up`
    printed that it was up, having read the other server's /readyz."""
    import socket

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        env = {**os.environ, "PORT": str(port), "CONVEYOR_CACHE": str(tmp_path), "MODEL": model_path}
        out = subprocess.run([sys.executable, "-m", "infra.cli", "up"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=120)
    assert out.returncode == 1 and f"port {port} on 127.0.0.1 is in use" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_up_refuses_weights_cut_short(tmp_path: Path, model_path: str) -> None:
    """A model whose weights file was cut short (a full disk, a killed copy): said at once, rather than a stack
    whose inference workers fail to load it again and again, each with a traceback."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(model_path, model, ignore=shutil.ignore_patterns("*.safetensors"))
    weights = next(Path(model_path).glob("*.safetensors"))
    with open(weights, "rb") as src, open(model / weights.name, "wb") as dst:
        dst.write(src.read(1 << 20))
    env = {**os.environ, "MODEL": str(model), "CONVEYOR_CACHE": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-m", "infra.cli", "up"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1 and "are cut short or damaged" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_up_says_when_redis_refuses_its_password(tmp_path: Path, model_path: str) -> None:
    """A Redis that answers and refuses the password (or wants one): said so, once, at once. Before, every process
    retried it as an unreachable Redis and said, after 10 s and six tracebacks, that no Redis answered."""
    from infra.redis_server import RedisServer

    server = RedisServer(tmp_path / "redis", password="right")
    url = server.start()
    try:
        for given, said in ((url.replace("right", "wrong"), "refused the password in REDIS_URL"),
                            (url.replace(":right@", ""), "wants a password, and none is in REDIS_URL")):
            env = {**os.environ, "REDIS_URL": given, "MODEL": model_path, "CONVEYOR_CACHE": str(tmp_path / "c")}
            out = subprocess.run([sys.executable, "-m", "infra.cli", "up"], cwd=ROOT, env=env, capture_output=True,
                                 text=True, timeout=60)
            assert out.returncode == 1 and said in out.stderr and "Traceback" not in out.stderr, out.stderr
    finally:
        server.stop()


def test_an_invalid_setting_does_not_print_the_secrets_beside_it(tmp_path: Path) -> None:
    """A check across settings gets every value from pydantic: none is printed, a password in REDIS_URL least."""
    env = {**os.environ, "ENGINE": "bogus", "WEBHOOK_SECRET": "topsecret-hmac", "CONVEYOR_CACHE": str(tmp_path),
           "REDIS_URL": "redis://:hunter2@10.0.0.5:6379/0"}
    out = subprocess.run([sys.executable, "-m", "infra.cli", "up"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1 and out.stderr.startswith("invalid settings:") and "ENGINE" in out.stderr, out.stderr
    assert "hunter2" not in out.stderr and "topsecret" not in out.stderr, out.stderr


def test_up_says_when_its_redis_append_only_file_is_damaged(tmp_path: Path, model_path: str) -> None:
    """The embedded Redis refuses a damaged append-only file: `up` ends in one line that says where the file is and
    what repairs it (the redis-check-aof its log advises is not in the embedded server's wheel), not a traceback."""
    (tmp_path / "redis").mkdir()
    (tmp_path / "redis" / "appendonly.aof").write_bytes(b"*2\r\n$6\r\nSELECT\r\n$1\r\n0\r\n*garbage\r\n")
    env = {**os.environ, "CONVEYOR_CACHE": str(tmp_path), "MODEL": model_path, "PORT": "0"}
    out = subprocess.run([sys.executable, "-m", "infra.cli", "up"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1 and "the stack's Redis did not start" in out.stderr, out.stderr
    assert "is damaged" in out.stderr and "redis-tools" in out.stderr and "Traceback" not in out.stderr, out.stderr
