"""Shared fixtures: one real redis-server for the session, the real default model, a tiny model, and
the whole stack (started by harness/stack.py, the launcher the benchmarks use too)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from _pytest.nodeid import NodeId

# torch's OpenMP threads sleep while they wait instead of spinning, in this process (engines and kernels under test)
# and in every process the tests start (stacks' workers, benchmarks, the lm-eval reference): a suite runs a dozen
# stacks and runs on 2 cores, and a spinning thread takes the core from the work beside it (spinning in this process
# alone cost ~60 CPU-s a run, 476 against 335 in all; the schema fuzzer's run took 56 s against 46 with the stacks'
# workers spinning). (The engine's own pool of threads sleeps at once by default anyway: docs/bench-log.md,
# "Contention".) Set before anything here loads torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# and nothing binds its compute threads to cores: `conveyor up` binds a lone inference worker's (infra/supervisor.py
# `one_worker_binds`), and the suite's many stacks would all crowd the same two
os.environ.setdefault("CPU_BIND_THREADS", "false")

import harness.stack
from harness.models import make_lora_adapter, make_tiny_model
from harness.stack import ROOT, Stack, stop_stack
from infra.redis_server import RedisServer
from shared.settings import Settings
from tests import durations
from tests.helpers import in_process_api
from workers.tokenizer.grammar import GrammarCompiler

__all__ = ["ROOT", "Stack", "launch_stack", "own_redis", "start_stack", "stop_stack"]
GRAMMAR_TTL_S = 600  # compiled grammars' TTL in the grammar_compiler fixture


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> Iterator[None]:
    """The tests that share what costs to start run in one worker (`--dist loadgroup`), which starts it once: a
    test on one of the session's shared stacks joins that stack's group, a test on a fixture of its module's own
    (module or class scope: a stack, an engine, a server) joins its module's group; groups that share a test
    are one (`_joined_groups`).

    The units (a group, or a test alone) are ordered longest first, as the last whole run took them
    (tests/durations.py), and xdist hands them out in that order (`--no-loadscope-reorder`)."""
    grouped = _joined_groups(items)
    for item, group in grouped.items():
        for name in group:
            item.add_marker(pytest.mark.xdist_group(name))
    yield  # (pytest's own order first: items sharing a parametrized fixture's value side by side)
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        units.setdefault(_group_name(item) or item.nodeid, []).append(item)
    took = durations.load()
    ordered = sorted(units.items(), key=lambda unit: (-took.get(unit[0], 0.0), -len(unit[1])))
    items[:] = [item for _, unit in ordered for item in unit]
    if getattr(config.option, "loadgroup", False):  # in a worker of --dist loadgroup
        for item in items:
            _name_group(item)


def _joined_groups(items: list[pytest.Item]) -> dict[pytest.Item, list[str]]:
    """Each grouped test's group, as the names it is made of: the groups a test is in (marked, its shared
    stacks, else its module's own fixtures: a module's fixture does not join two shared stacks' groups into one),
    joined wherever one test is in two."""
    root: dict[str, str] = {}

    def find(name: str) -> str:
        while root.setdefault(name, name) != name:
            name = root[name]
        return name

    names = {item: _marked_groups(item) | (_stacks_used(item) or _module_fixtures_used(item)) for item in items}
    for first, *rest in (sorted(n) for n in names.values() if n):
        for name in rest:
            root[find(name)] = find(first)
        find(first)
    members: dict[str, list[str]] = {}
    for name in sorted(root):
        members.setdefault(find(name), []).append(name)
    return {item: members[find(next(iter(n)))] for item, n in names.items() if n}


def _marked_groups(item: pytest.Item) -> set[str]:
    return {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}


def _module_fixtures_used(item: pytest.Item) -> set[str]:
    """{the test's module} if it uses a fixture of module or class scope defined in the suite (each module gets its
    own instance, which a second worker would build again); else empty."""
    info = getattr(item, "_fixtureinfo", None)
    module = getattr(item, "module", None)
    if info is None or module is None:
        return set()
    for name in item.fixturenames:  # type: ignore[attr-defined]
        defs = info.name2fixturedefs.get(name) or ()
        if defs and defs[-1].scope in ("module", "class") and defs[-1].baseid.startswith("tests"):
            return {module.__name__.removeprefix("tests.")}
    return set()


def _name_group(item: pytest.Item) -> None:
    """The test's group as the suffix of its id (`test_x@stack`), which is how a worker tells the scheduler: pytest
    9.2 builds the id from its structured form, so the suffix pytest-xdist 3.8 writes is lost (pytest-dev/pytest-xdist
    issue 1386); written here where it is missing."""
    name = _group_name(item)
    if name and not item.nodeid.endswith("@" + name) and hasattr(item, "_id"):
        item._id = NodeId.parse(f"{item.nodeid}@{name}")


def _group_name(item: pytest.Item) -> str:
    """The name xdist knows the test's group by ('' for a test alone)."""
    return "_".join(sorted(_marked_groups(item)))


def own_redis(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[RedisServer]:
    """A redis-server of its own, in a fresh directory, for a fixture to yield from."""
    server = RedisServer(tmp_path_factory.mktemp(name))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    yield from own_redis(tmp_path_factory, "redis")


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


@pytest.fixture
async def app_client(redis_server: RedisServer, model_path: str) -> AsyncIterator[httpx.AsyncClient]:
    """The API in this process on db 13 of the session's Redis (emptied after), the tests' limits, no workers: for
    what a response's shape shows (status codes, error bodies, headers) without a stack (tests/api/test_door.py)."""
    url = redis_server.url.rsplit("/", 1)[0] + "/13"
    async with in_process_api(Settings(redis_url=url, model=model_path, webhook_allow_private=True,
                                       max_tokens_cap=int(TEST_ENV["MAX_TOKENS_CAP"]),
                                       max_model_len=int(TEST_ENV["MAX_MODEL_LEN"]))) as client:
        yield client


@pytest.fixture(scope="session")
def bytes_db(redis_url: str) -> Iterator[redis.Redis]:
    """redis_db's database (db 15) as bytes, for what stores binary values (compiled grammars)."""
    client = redis.Redis.from_url(redis_url.rsplit("/", 1)[0] + "/15")
    yield client
    client.close()


@pytest.fixture(scope="session")
def _grammar_compiler(model_path: str, bytes_db: redis.Redis) -> Iterator[GrammarCompiler]:
    compiler = GrammarCompiler(model_path, bytes_db, GRAMMAR_TTL_S)
    compiler.warm()
    yield compiler
    compiler.close()


@pytest.fixture
def grammar_compiler(_grammar_compiler: GrammarCompiler, redis_db: redis.Redis) -> GrammarCompiler:
    """The tokenizer pool's grammar compiler for the default model, storing in db 15 (flushed for each test,
    so it forgets what it stored); its child process (~3.5 s to start: xgrammar, torch, the tokenizer) is one
    for the session."""
    _grammar_compiler.forget()
    return _grammar_compiler


@pytest.fixture(scope="session")
def model_path() -> str:
    path = Settings().model_path
    if not (Path(path) / "model.safetensors").exists() and not os.environ.get("MODEL"):
        pytest.fail(f"default model missing at {path}: run `conveyor model pull` (make test does)")
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> str:
    """A randomly initialised Llama of the default model's shape family, tiny, with the real tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), model_path)


@pytest.fixture(scope="session")
def tiny_loras(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> dict[str, str]:
    """LoRA adapters of the tiny model, by name: "tiny-all" (every projection, rank 8) and "tiny-attn" (attention,
    rank 16, rsLoRA) are the tiny stacks' LORA_MODULES; "tiny-late" is for loading at run time."""
    tmp = tmp_path_factory.mktemp("tiny-loras")
    return {"tiny-all": make_lora_adapter(tmp / "all", tiny_model_dir, 1, r=8),
            "tiny-attn": make_lora_adapter(tmp / "attn", tiny_model_dir, 2, r=16, use_rslora=True,
                                           target_modules=["q_proj", "v_proj", "o_proj"]),
            "tiny-late": make_lora_adapter(tmp / "late", tiny_model_dir, 3, r=4,
                                           target_modules=["gate_proj", "up_proj", "down_proj"])}


@pytest.fixture(scope="session")
def smol_lora(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> str:
    """A LoRA adapter of the default model (rank 8, every projection, B scaled down: a fine-tune's size of change),
    the default stack's LORA_MODULES "smol-lora"."""
    return make_lora_adapter(tmp_path_factory.mktemp("smol-lora"), model_path, 4, r=8, scale=0.05)


def lora_env(loras: dict[str, str], served: list[str]) -> dict[str, str]:
    return {"LORA_MODULES": " ".join(f"{n}={loras[n]}" for n in served), "ALLOW_RUNTIME_LORA_UPDATING": "true"}


# the tests' stack: fast redelivery and heartbeats, small limits, webhooks to 127.0.0.1 allowed
TEST_ENV = {
    "CLAIM_IDLE_MS": "3000", "REFRESH_S": "0.5", "HEARTBEAT_S": "1", "MAX_MODEL_LEN": "1024",
    "MAX_TOKENS_CAP": "1000", "DRAIN_GRACE_S": "10", "LOG_LEVEL": "WARNING",
    "WEBHOOK_ALLOW_PRIVATE": "1",  # the tests' webhook receivers listen on 127.0.0.1
}
# DTYPE is left at its default (`auto`: bfloat16 on a CPU with AVX512-BF16 or AMX), so that the tests that compare
# texts across batches, resumes and redeliveries hold the seed promise where users run it. The session's shared
# stacks run float32: their tests also compare our texts with transformers' and PEFT's float32 references.
REFERENCE_DTYPE = {"DTYPE": "float32"}


def start_stack(tmp: Path, redis_url: str, model: str, extra: dict[str, str] | None = None,
                args: list[str] | None = None, ready_path: str = "/readyz", autoscale: bool = False) -> Stack:
    """The whole stack under the real supervisor (`conveyor up`) on `redis_url` ("": its own Redis), ready."""
    return launch_stack(tmp, redis_url, model, extra, args, autoscale).wait_ready(ready_path)


def launch_stack(tmp: Path, redis_url: str, model: str, extra: dict[str, str] | None = None,
                 args: list[str] | None = None, autoscale: bool = False) -> Stack:
    """`start_stack`, not waited for (`Stack.wait_ready`)."""
    return harness.stack.launch_stack(tmp, redis_url, model, {**TEST_ENV, **(extra or {})}, args, autoscale)


# the session's shared stacks load the grammar machinery at start rather than in the first structured-output test
# that reaches each (~7 s per stack)
SHARED_STACK_ENV = {"GRAMMAR_WARM": "true"}


Get = Callable[[str], Any]  # a session fixture's value by name


def _launch_stack(get: Get) -> Stack:
    tmp, server = get("tmp_path_factory"), get("redis_server")
    return launch_stack(tmp.mktemp("stack"), server.url, get("model_path"),
                        {**SHARED_STACK_ENV, **REFERENCE_DTYPE, "SPECULATIVE": "ngram",
                         "LORA_MODULES": f"smol-lora={get('smol_lora')}"})


def _launch_tiny_stack(get: Get) -> Stack:
    tmp, server = get("tmp_path_factory"), get("redis_server")
    url = server.url.rsplit("/", 1)[0] + "/1"
    redis.Redis.from_url(url).flushdb()
    loras = lora_env(get("tiny_loras"), ["tiny-all", "tiny-attn"])
    return launch_stack(tmp.mktemp("tiny-stack"), url, get("tiny_model_dir"),
                        {**SHARED_STACK_ENV, **REFERENCE_DTYPE, **loras})


def _launch_cluster_stack(get: Get) -> Stack:
    loras = lora_env(get("tiny_loras"), ["tiny-all", "tiny-attn"])
    return launch_stack(get("tmp_path_factory").mktemp("cluster-stack"), "", get("tiny_model_dir"),
                        {**SHARED_STACK_ENV, **REFERENCE_DTYPE, **loras}, args=["--redis-cluster", "3"])


# the session's shared stacks, by fixture; the tests on each form one group (`pytest_collection_modifyitems`)
SESSION_STACKS: dict[str, Callable[[Get], Stack]] = {
    "stack": _launch_stack, "tiny_stack": _launch_tiny_stack, "cluster_stack": _launch_cluster_stack}


def _stacks_used(item: pytest.Item) -> set[str]:
    names = set(getattr(item, "fixturenames", ()))
    used = names & SESSION_STACKS.keys()
    if "plumbing_stack" in names:  # parametrized: tiny_stack or cluster_stack (`plumbing_stack`)
        callspec = getattr(item, "callspec", None)
        used.add("cluster_stack" if callspec and callspec.params.get("plumbing_stack") == "cluster" else "tiny_stack")
    return used


@dataclass
class _Shared:
    """A session stack as started, how to start it again, and whether it was stopped after its last test."""
    stack: Stack
    launch: Callable[[], Stack]
    stopped: bool = False


_SHARED: dict[str, _Shared] = {}  # this process's session stacks, by fixture name
_LAST_USERS: dict[str, str] = {}  # each session stack's last test in the run's order (its nodeid)


def _session_stack(request: pytest.FixtureRequest, name: str) -> Iterator[Stack]:
    got: dict[str, Any] = {}

    def get(fixture: str) -> Any:  # resolved while this fixture is set up, kept for a start again
        if fixture not in got:
            got[fixture] = request.getfixturevalue(fixture)
        return got[fixture]

    def launch() -> Stack:
        return SESSION_STACKS[name](get).wait_ready()

    shared = _Shared(launch(), launch)
    _SHARED[name] = shared
    try:
        yield shared.stack
    finally:
        _SHARED.pop(name, None)
        if not shared.stopped:
            stop_stack(shared.stack)


def pytest_collection_finish(session: pytest.Session) -> None:
    for item in session.items:  # in the order they run: a worker of --dist loadgroup runs a group in this order
        for name in _stacks_used(item):
            _LAST_USERS[name] = item.nodeid


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """A session stack stops once its last test is done rather than at the session's end: an idle stack on a
    Redis Cluster takes ~0.16 CPU-s a second from the tests beside it (its consumers' turns over 12 partitions)."""
    yield
    for name in _stacks_used(item):
        shared = _SHARED.get(name)
        if shared is not None and not shared.stopped and _LAST_USERS.get(name) == item.nodeid:
            shared.stopped = True
            stop_stack(shared.stack)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test that runs after its stack's last test (an order other than the collected one) starts it again, in
    place: the fixture's value is the same object."""
    for name in _stacks_used(item):
        shared = _SHARED.get(name)
        if shared is not None and shared.stopped:
            fresh = shared.launch()
            for f in fields(Stack):
                setattr(shared.stack, f.name, getattr(fresh, f.name))
            shared.stopped = False


@pytest.fixture(scope="session")
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    """The real default model behind the full stack (db 0 of the session's Redis): for what only a real
    model shows (a right answer, a stop string it writes). It decodes speculatively (SPECULATIVE=ngram), which
    changes no output: every test on it, lm-eval's scores against transformers' among them, checks that too."""
    yield from _session_stack(request, "stack")


@pytest.fixture(scope="session")
def cluster_stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    """`tiny_stack` on a local Redis Cluster (3 masters, 3 replicas: `conveyor up --redis-cluster 3`)."""
    yield from _session_stack(request, "cluster_stack")


@pytest.fixture(scope="session", params=["single", "cluster"])
def plumbing_stack(request: pytest.FixtureRequest) -> Stack:
    """The tiny-model stack on one Redis node, then on a Redis Cluster: the HTTP contract holds on both."""
    return request.getfixturevalue("tiny_stack" if request.param == "single" else "cluster_stack")  # type: ignore[no-any-return]


@pytest.fixture(scope="session")
def tiny_stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    """The tiny model behind the full stack (db 1 of the session's Redis): the same processes and path as
    `stack`, many times faster per token, for behaviour that holds whatever the weights."""
    yield from _session_stack(request, "tiny_stack")
