"""Network partitions against the whole stack, on namespaces (harness/netns.py): the scenarios that
tests/e2e/test_partitions.py runs once and bench/partitions.py repeats. Each starts what it needs (a Redis of its
own, bound to 127.0.0.1 and to the root side of a veth link; a stack under `conveyor up` in the root namespace on
127.0.0.1; the process under test inside a namespace, reaching Redis across the link), cuts the link, heals it, and
returns an `Outcome`: jobs accepted, lost (never ended), duplicated (a repeated event seq, or a text other than a
clean run's), and every failed check in words (`problems`; none: the run passed).

- `api`: the API alone, in its namespace, cut off from Redis (its clients reach it on a second link, never cut).
  While cut, submits and polls answer 503 with Retry-After within the API's own timeouts, never a 500 and never a
  hang; after the heal every job accepted before the cut answers and ends succeeded, new submits are accepted
  (and streamed live), and a submit answered 503 retried with its Idempotency-Key makes one job.
- `inference`: an inference worker cut off while it runs jobs, for longer than CLAIM_IDLE_MS; a second worker, in
  the root namespace, claims and finishes them exactly once (succeeded, event seqs 1..n without a gap or a repeat,
  the clean run's text), and once the cut-off worker is back (its heartbeat again, its engine idle) nothing of the
  finished jobs has changed, and it wrote nothing into them (Redis's MONITOR, attributed by client address).
- `tokenizer`: the same for a tokenizer worker cut off with entries of `jobs` delivered to it (Redis answered its
  blocked XREADGROUP into the cut): claimed and tokenized exactly once (the fair queue's arrivals counter).
- `cluster`: no stack; a local Redis Cluster (3 masters, 3 replicas) whose one master runs in a namespace beside a
  client of its own, the rest in the root namespace with another client, both writing SET then WAIT 1 (a write is
  acknowledged once a replica has it, as conveyor's promises are); the master is cut off until the majority has
  failed it over, then healed. No acknowledged write of either side is lost, and the minority's writes are refused
  once they can no longer be copied (min-replicas-to-write / min-replicas-max-lag, cluster-node-timeout).

Greedy float32 decoding on a model of the caller's (the tiny model in the tests) gives every job with the same
prompt the same text, whichever worker runs or resumes it, which is what "the clean run's text" relies on.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import redis
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

from harness import netns
from harness.sse import check_events, read_events, tokens_text
from harness.stack import ROOT, Stack, start_stack, stop_stack, until, wait_http
from infra.redis_cluster import ClusterNode, LocalCluster, _parse_nodes
from infra.redis_server import RedisServer, free_port
from shared import names
from shared.jobs import TERMINAL
from shared.lifecycle import preexec_die_with_parent

# fast redelivery and heartbeats, the default dtype (the suite's TEST_ENV, for callers that bring none)
ENV = {"CLAIM_IDLE_MS": "3000", "REFRESH_S": "0.5", "HEARTBEAT_S": "1", "MAX_MODEL_LEN": "1024",
       "MAX_TOKENS_CAP": "1000", "DRAIN_GRACE_S": "10", "LOG_LEVEL": "WARNING",
       "OMP_WAIT_POLICY": "PASSIVE"}  # (OpenMP threads that sleep while they wait: 2 cores, several stacks)
# the longest a request to the cut-off API may take: one Redis call's read timeout (socket_timeout 10 s), its one
# retry on a new connection (connect timeout 2 s) and the pool's wait (10 s) are the API's own bounds (shared/
# redis_client.py, async_client); a little over twice one call's, for a handler that makes two before it fails
API_ANSWER_LIMIT_S = 25.0
PROMPTS = [f"Story number {i}:" for i in range(4)]


@dataclass
class Outcome:
    """What one run of a scenario counted, and what went wrong (`problems`: none when it passed)."""

    scenario: str
    accepted: int = 0  # jobs answered 202 that the run checks
    lost: int = 0  # of those, never ended
    duplicated: int = 0  # of those, an event seq repeated, a text other than the clean run's, or changed after the end
    problems: list[str] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)  # measurements for the report

    @property
    def passed(self) -> bool:
        return not self.problems

    def problem(self, what: str) -> None:
        self.problems.append(what)


class PartitionRedis(RedisServer):
    """The scenario's Redis: the embedded redis-server (append-only, fsync always, a password), bound to
    127.0.0.1 for the root namespace and to `also_bind` (a link's root side) for the namespace's processes."""

    def __init__(self, data_dir: Path, also_bind: str) -> None:
        super().__init__(data_dir)
        self.also_bind = also_bind

    def write_config(self) -> Path:
        path = super().write_config()
        with open(path, "a") as f:  # a later `bind` wins; two addresses are two arguments, not one quoted string
            f.write(f"bind 127.0.0.1 {self.also_bind}\n")
        return path

    def url_at(self, host: str) -> str:
        return f"redis://:{quote(self.password, safe='')}@{host}:{self.port}/0"


# ---- the pieces each scenario uses -------------------------------------------------------------------------------


def spawn(argv: list[str], env: dict[str, str], log: Path,
          ns: netns.Namespace | None = None) -> subprocess.Popen[bytes]:
    """A process of the scenario (inside `ns` when given), dying with this one, its output in `log`."""
    with open(log, "ab") as out:
        kwargs: dict[str, Any] = {"env": env, "cwd": ROOT, "stdout": out, "stderr": subprocess.STDOUT,
                                  "preexec_fn": preexec_die_with_parent()}
        return ns.popen(argv, **kwargs) if ns is not None else subprocess.Popen(argv, **kwargs)


def stop(proc: subprocess.Popen[bytes] | None, timeout: float = 20) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def worker_id_of(r: redis.Redis, pool: str, pid: int) -> str | None:
    """The id of `pid`'s worker in `pool`'s registry (live or not), from its heartbeat."""
    for wid in r.zrange(names.workers_key(pool), 0, -1):
        beat = heartbeat(r, pool, wid)
        if beat is not None and beat.get("pid") == pid:
            return str(wid)
    return None


def heartbeat(r: redis.Redis, pool: str, worker_id: str) -> dict[str, Any] | None:
    raw = r.get(names.heartbeat_key(pool, worker_id))
    return json.loads(raw) if raw else None


def submit(client: httpx.Client, body: dict[str, Any], key: str | None = None) -> httpx.Response:
    return client.post("/v1/jobs", json=body, headers={"Idempotency-Key": key} if key else None)


def accepted_id(client: httpx.Client, body: dict[str, Any]) -> str:
    r = submit(client, body)
    if r.status_code != 202:
        raise AssertionError(f"submit answered {r.status_code}: {r.text[:300]}")
    return str(r.json()["id"])


def record(r: redis.Redis, job_id: str) -> dict[str, str]:
    return r.hgetall(names.job_key(job_id))  # type: ignore[return-value]


def wait_ended(r: redis.Redis, job_ids: list[str], timeout: float) -> dict[str, dict[str, str]]:
    """Each job's record once it has ended, or as it stands at the deadline (read from Redis, not the API)."""
    deadline = time.monotonic() + timeout
    out: dict[str, dict[str, str]] = {}
    while True:
        for job_id in job_ids:
            if job_id not in out or out[job_id].get("status") not in TERMINAL:
                out[job_id] = record(r, job_id)
        if all(rec.get("status") in TERMINAL for rec in out.values()) or time.monotonic() > deadline:
            return out
        time.sleep(0.1)


def job_keys(job_id: str) -> list[str]:
    """Every key a job's record, output and stream live in, and its channel."""
    return [names.job_key(job_id), names.events_key(job_id), names.tokens_key(job_id), names.text_key(job_id),
            names.logprobs_key(job_id), names.job_channel(job_id)]


def snapshot(r: redis.Redis, job_id: str) -> dict[str, Any]:
    """What a finished job is in Redis: its record, its event stream, its text and token ids."""
    return {"record": record(r, job_id), "events": r.xrange(names.events_key(job_id)),
            "text": r.get(names.text_key(job_id)), "tokens": r.strlen(names.tokens_key(job_id))}


def snapshot_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    out = []
    for part in ("events", "text", "tokens"):
        if before[part] != after[part]:
            out.append(f"{part}: {str(before[part])[:120]!r} -> {str(after[part])[:120]!r}")
    rec_a, rec_b = before["record"], after["record"]
    for k in sorted(set(rec_a) | set(rec_b)):
        if rec_a.get(k) != rec_b.get(k):
            out.append(f"record.{k}: {rec_a.get(k)!r} -> {rec_b.get(k)!r}")
    return out


def check_job(client: httpx.Client, job_id: str, rec: dict[str, str], clean: str, outcome: Outcome,
              max_tokens: int | None = None) -> None:
    """A job accepted: ended, succeeded, the clean run's text, a stream of seqs 1..n that joins to it."""
    status = rec.get("status")
    if status not in TERMINAL:
        outcome.lost += 1
        outcome.problem(f"{job_id} never ended (status {status}, {rec.get('completion_tokens')} tokens, "
                        f"worker {rec.get('worker')})")
        return
    if status != "succeeded":
        outcome.problem(f"{job_id} ended {status}: {rec.get('error')}")
        return
    polled = client.get(f"/v1/jobs/{job_id}")
    if polled.status_code != 200:
        outcome.problem(f"polling {job_id} after the heal answered {polled.status_code}: {polled.text[:200]}")
        return
    job = polled.json()
    duplicated = False
    if job["text"] != clean:
        duplicated = True
        outcome.problem(f"{job_id}: text differs from the clean run's: {job['text'][:80]!r} vs {clean[:80]!r}")
    if max_tokens is not None and job["usage"]["completion_tokens"] != max_tokens:
        outcome.problem(f"{job_id}: {job['usage']['completion_tokens']} completion tokens, not {max_tokens}")
    events = read_events(client, job_id)
    seqs = [int(e["id"]) for e in events if "id" in e]
    if len(seqs) != len(set(seqs)):
        duplicated = True
        outcome.problem(f"{job_id}: event seqs repeat: {[s for s, n in Counter(seqs).items() if n > 1][:10]}")
    bad = check_events(events, job["text"])
    if bad:
        duplicated = duplicated or "contiguous" in bad
        outcome.problem(f"{job_id}: its event stream: {bad}")
    if duplicated:
        outcome.duplicated += 1


class Monitor:
    """Redis's MONITOR from now on: the commands of the clients at `address` (an IP), with what their scripts ran
    (MONITOR logs a script's own commands as client `lua` right after the call that ran it)."""

    WRITES = {"set", "setrange", "append", "hset", "hsetnx", "hincrby", "hincrbyfloat", "hdel", "del", "unlink",
              "xadd", "xack", "xclaim", "xautoclaim", "xdel", "xtrim", "expire", "pexpire", "incr", "incrby", "decr",
              "decrby", "zadd", "zrem", "zincrby", "zremrangebyscore", "lpush", "rpush", "ltrim", "lpop", "rpop",
              "publish", "spublish", "sadd", "srem", "getdel", "xreadgroup", "blpop", "brpop"}
    _ARG = re.compile(r'"((?:[^"\\]|\\.)*)"')

    def __init__(self, url: str, address: str) -> None:
        self.address = address
        self.lines: list[tuple[float, str, list[str]]] = []  # (time, via: "direct" | the script call's name, args)
        self.client = redis.Redis.from_url(url)
        self.mon = self.client.monitor()
        self.mon.__enter__()  # MONITOR is on before this returns: nothing after it is missed
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._read, name="monitor", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        caller = ""
        call = ""
        with contextlib.suppress(redis.RedisError, OSError, ValueError):
            while not self.done.is_set():
                raw = self.mon.connection.read_response()
                line = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
                stamp, _, rest = line.partition(" ")
                m = re.match(r"\[(\d+) ([^\]]+)\] (.*)", rest)
                if not m:
                    continue
                who, args = m[2], self._ARG.findall(m[3])
                if not args:
                    continue
                if who != "lua":
                    caller, call = who.rsplit(":", 1)[0], args[0].lower()
                    if caller == self.address:
                        self.lines.append((float(stamp), "direct", args))
                elif caller == self.address:
                    self.lines.append((float(stamp), call, args))

    def close(self) -> None:
        self.done.set()
        with contextlib.suppress(Exception):
            self.mon.connection.disconnect()
        self.thread.join(5)
        with contextlib.suppress(Exception):
            self.client.close()

    def writes(self, keys: set[str]) -> list[str]:
        """Each write command of the watched clients (their own or their scripts') that names one of `keys`."""
        out = []
        for _, via, args in self.lines:
            if args[0].lower() in self.WRITES and any(a in keys for a in args[1:]):
                shown = " ".join(a if len(a) < 60 else a[:57] + "..." for a in args[:4])
                out.append(f"{shown} (via {via})" if via != "direct" else shown)
        return out

    def counts(self, writes_only: bool = False) -> dict[str, int]:
        """The watched clients' commands (or their writes alone) by name, scripts' under their call's name."""
        return dict(Counter(f"{args[0].lower()}" + (f" in {via}" if via != "direct" else "")
                            for _, via, args in self.lines if not writes_only or args[0].lower() in self.WRITES))


class Scene:
    """A lab with one namespace and its link, a Redis bound to the link's root side, a stack under `conveyor up` in
    the root namespace on 127.0.0.1 (`stack_args`), and whatever the scenario starts; all of it gone at the end."""

    def __init__(self, workdir: Path, model: str, env: dict[str, str] | None, stack_args: list[str],
                 ready_path: str, label: str) -> None:
        self.workdir, self.model, self.env = workdir, model, {**ENV, **(env or {})}
        self.stack_args, self.ready_path, self.label = stack_args, ready_path, label
        self.exits = contextlib.ExitStack()
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Scene:
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self.lab = self.exits.enter_context(netns.NetLab())
            self.ns = self.lab.namespace(self.label)
            self.link = self.ns.link()
            self.server = PartitionRedis(self.workdir / "redis", self.link.host_ip)
            self.server.start()
            self.exits.callback(self.server.stop)
            self.stack: Stack = start_stack(self.workdir / "stack", self.server.url, self.model, self.env,
                                            ["--celery", "0", *self.stack_args], ready_path=self.ready_path)
            self.exits.callback(stop_stack, self.stack)
            self.exits.callback(self._stop_procs)  # before the stack and Redis go (a worker drains against Redis)
            self.r = redis.Redis.from_url(self.server.url, decode_responses=True)
            self.exits.callback(self.r.close)
        except BaseException:
            self.exits.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if getattr(self, "link", None) is not None and self.link.is_cut:
            self.link.heal()  # let what is inside drain against Redis
        self.exits.close()

    def _stop_procs(self) -> None:
        for p in self.procs:
            stop(p)

    def ns_env(self, **extra: str) -> dict[str, str]:
        """The stack's environment for a process inside the namespace: Redis across the link."""
        return {**self.stack.env, "REDIS_URL": self.server.url_at(self.link.host_ip), **extra}

    def start(self, role: str, inside: bool, log: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """`conveyor <role>` (api, tokenizer, inference): inside the namespace (Redis across the link), or in the
        root namespace on 127.0.0.1 as the stack's own are."""
        proc = spawn([sys.executable, "-m", "infra.cli", role], env or (self.ns_env() if inside else self.stack.env),
                     self.workdir / log, self.ns if inside else None)
        self.procs.append(proc)
        return proc

    def wait_worker(self, pool: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> str:
        def live() -> str | None:
            if proc.poll() is not None:
                raise RuntimeError(f"the {pool} worker exited with {proc.returncode} before it was live")
            return worker_id_of(self.r, pool, proc.pid)
        return until(f"the {pool} worker {proc.pid}'s heartbeat", live, timeout, every=0.1)

    def clean_texts(self, client: httpx.Client, body: dict[str, Any]) -> dict[str, str]:
        """Each prompt's text on the stack before any cut: what every later job with that prompt must end with."""
        ids = {p: accepted_id(client, {**body, "prompt": p}) for p in PROMPTS}
        ended = wait_ended(self.r, list(ids.values()), timeout=180)
        for p, job_id in ids.items():
            if ended[job_id].get("status") != "succeeded":
                raise RuntimeError(f"the clean run of {p!r} did not succeed: {ended[job_id]}")
        return {p: str(client.get(f"/v1/jobs/{job_id}").json()["text"]) for p, job_id in ids.items()}

    def orphans(self) -> list[str]:
        """The namespace's connections to Redis that their process has closed and the kernel still holds (their data
        or FIN not yet through): `ss` states FIN-WAIT-1, CLOSING, LAST-ACK."""
        done = self.ns.run(["ss", "-Htan", "dst", f"{self.link.host_ip}:{self.server.port}"], check=False)
        return [line for line in done.stdout.splitlines()
                if line.split() and line.split()[0] in ("FIN-WAIT-1", "CLOSING", "LAST-ACK")]

    def settled(self, pool: str, worker_id: str, healed_at: float, timeout: float) -> dict[str, Any]:
        """Wait until the worker cut off is back: a heartbeat written after the heal, its engine (if any) idle, and
        two heartbeats more (each HEARTBEAT_S apart), time for what it held to reach Redis."""
        def back() -> dict[str, Any] | None:
            beat = heartbeat(self.r, pool, worker_id)
            idle = beat is not None and not beat.get("running") and not beat.get("waiting")
            return beat if beat is not None and beat["at"] > healed_at and idle else None
        first = until(f"the {pool} worker's heartbeat after the heal", back, timeout, every=0.1)
        seen = [first["at"]]

        def beats_more() -> bool:
            beat = back()
            if beat is not None and beat["at"] > seen[-1]:
                seen.append(beat["at"])
            return len(seen) >= 3
        until(f"two more heartbeats of the {pool} worker", beats_more, timeout, every=0.1)
        return {"back_after_heal_s": round(first["at"] - healed_at, 2)}


def _finished_and_unchanged(scene: Scene, job_ids: list[str], pool: str, worker_id: str, healed_at: float,
                            before: dict[str, dict[str, Any]], monitor: Monitor, outcome: Outcome) -> None:
    """After the heal, once the cut-off worker is back: nothing of the finished jobs changed after their end, and it
    wrote nothing into them since the heal (MONITOR from just before it)."""
    try:
        outcome.notes.update(scene.settled(pool, worker_id, healed_at, timeout=180))
    except TimeoutError as e:
        outcome.problem(f"the cut-off {pool} worker did not come back: {e}")
    monitor.close()
    for job_id in job_ids:
        changes = snapshot_changes(before[job_id], snapshot(scene.r, job_id))
        if changes:
            outcome.duplicated += 1
            outcome.problem(f"{job_id} changed after it ended: {'; '.join(changes)[:600]}")
    keys = {k for job_id in job_ids for k in job_keys(job_id)}
    writes = monitor.writes(keys)
    outcome.notes["returning worker's writes into its lost jobs"] = len(writes)
    outcome.notes["returning worker's commands"] = monitor.counts()
    if writes:
        shown = Counter(re.sub(r"job_[0-9a-f]+", "job_…", w) for w in writes)
        outcome.problem(f"the returning {pool} worker wrote {len(writes)} times into jobs no longer its own "
                        "(another worker's, or ended): "
                        + "; ".join(f"{n}x {w}" for w, n in shown.most_common(12)))


# ---- the scenarios -----------------------------------------------------------------------------------------------


def api_cut(workdir: Path, model: str, env: dict[str, str] | None = None, jobs: int = 4, max_tokens: int = 200,
            waves: int = 2, per_wave: int = 3) -> Outcome:
    """The API alone, inside its namespace, cut off from Redis; its clients reach it on a second link."""
    outcome = Outcome("api")
    body = {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}
    with Scene(workdir, model, env, [], "/readyz", "api") as scene:
        client_link = scene.ns.link()  # the clients' way in: never cut
        port = free_port()
        api_env = scene.ns_env(HOST=client_link.ns_ip, PORT=str(port), INTERNAL_PORT=str(free_port()), AUTH="off")
        api = scene.start("api", True, "api-ns.log", api_env)
        url = f"http://{client_link.ns_ip}:{port}"
        wait_http(url + "/readyz", api, 120, "the API in its namespace")  # type: ignore[arg-type]
        with httpx.Client(base_url=url, timeout=60) as client:
            clean = scene.clean_texts(client, body)
            before = {accepted_id(client, {**body, "prompt": PROMPTS[i % len(PROMPTS)]}): PROMPTS[i % len(PROMPTS)]
                      for i in range(jobs)}
            outcome.accepted = len(before)
            submitted = names.submitted_counter(0)
            count_at_cut = int(scene.r.get(submitted) or 0)
            keys = [f"partition-{uuid.uuid4().hex[:8]}-{i}" for i in range(waves * per_wave)]
            answers: list[dict[str, Any]] = []
            with scene.link.partitioned():
                for wave in range(waves):
                    calls: list[tuple[str, Callable[[], httpx.Response]]] = []
                    for i in range(per_wave):
                        key = keys[wave * per_wave + i] if i % 2 == 0 else None  # half with an Idempotency-Key
                        b = {**body, "prompt": PROMPTS[i % len(PROMPTS)]}
                        calls.append(("submit", lambda b=b, key=key: submit(client, b, key)))
                        job_id = list(before)[i % len(before)]
                        calls.append(("poll", lambda job_id=job_id: client.get(f"/v1/jobs/{job_id}")))
                    answers += _timed_concurrently(calls)
                cut_s = round(time.time() - scene.link.history[-1][1], 1)
            healed_at = time.time()
            outcome.notes["cut_s"] = cut_s
            _check_cut_answers(answers, outcome)
            # after the heal: accepted again, within the deadline
            t0 = time.monotonic()
            try:
                fresh = until("a submit to be accepted after the heal",
                              lambda: _accepted_or_none(client, {**body, "prompt": PROMPTS[0]}), timeout=60, every=0.2)
                outcome.notes["accepted_again_after_s"] = round(time.monotonic() - t0, 1)
            except TimeoutError as e:
                outcome.problem(str(e))
                return outcome
            new_ids = {str(fresh.json()["id"]): PROMPTS[0]}
            # a submit answered 503, sent again with its key, is one job (a first try that reached Redis after all,
            # its request held by the cut and delivered by the heal, is found again)
            replayed = 0
            keyed_ids: dict[str, str] = {}
            for wave in range(waves):
                for i in range(0, per_wave, 2):
                    key = keys[wave * per_wave + i]
                    b = {**body, "prompt": PROMPTS[i % len(PROMPTS)]}
                    first, again = submit(client, b, key), submit(client, b, key)
                    if first.status_code != 202 or again.status_code != 202 or first.json()["id"] != again.json()["id"]:
                        outcome.problem(f"a retry with Idempotency-Key {key} after the heal: {first.status_code} "
                                        f"{again.status_code} {first.text[:200]}")
                        continue
                    replayed += first.headers.get("idempotent-replayed") == "true"
                    keyed_ids[str(first.json()["id"])] = b["prompt"]
            outcome.notes["keyed 503s found as jobs on retry"] = replayed
            # a live stream of a new job: the API's pub/sub relay is back too
            live_id = accepted_id(client, {**body, "prompt": PROMPTS[1]})
            new_ids[live_id] = PROMPTS[1]
            live = read_events(client, live_id)
            if check_events(live, tokens_text(live)) or tokens_text(live) != clean[PROMPTS[1]]:
                outcome.problem(f"the live stream of {live_id} after the heal: {check_events(live, tokens_text(live))}"
                                f" / {tokens_text(live)[:60]!r}")
            # a request the cut held and the API gave up on may still reach Redis: its connection, closed, retransmits
            # what it had not got through, and the heal lets that through: wait until no such connection is left
            t0 = time.monotonic()
            try:
                until("the API's given-up connections to Redis to be gone", lambda: not scene.orphans(), timeout=180,
                      every=0.5)
            except TimeoutError as e:
                outcome.problem(f"{e}: {scene.orphans()}")
            outcome.notes["given-up connections gone after the heal (s)"] = round(time.monotonic() - t0, 1)
            everything = {**before, **new_ids, **keyed_ids}
            ended = wait_ended(scene.r, list(everything), timeout=180)
            for job_id, prompt in everything.items():
                check_job(client, job_id, ended[job_id], clean[prompt], outcome, max_tokens)
            outcome.accepted = len(everything)
            # jobs made by a submit answered 503: without a key, a client that retries makes a second one
            created = int(scene.r.get(submitted) or 0) - count_at_cut
            outcome.notes["jobs created by submits answered 503 (no key)"] = created - len(new_ids) - len(keyed_ids)
            outcome.notes["healed_after_cut_s"] = round(healed_at - scene.link.history[-2][1], 1)
    return outcome


def _accepted_or_none(client: httpx.Client, body: dict[str, Any]) -> httpx.Response | None:
    try:
        r = submit(client, body)
    except httpx.HTTPError:
        return None
    return r if r.status_code == 202 else None


def _timed_concurrently(calls: list[tuple[str, Callable[[], httpx.Response]]]) -> list[dict[str, Any]]:
    def one(call: tuple[str, Callable[[], httpx.Response]]) -> dict[str, Any]:
        kind, fn = call
        t = time.monotonic()
        try:
            r = fn()
            return {"kind": kind, "status": r.status_code, "s": time.monotonic() - t,
                    "retry_after": r.headers.get("retry-after"), "body": r.text[:300]}
        except httpx.HTTPError as e:
            return {"kind": kind, "status": None, "s": time.monotonic() - t, "error": repr(e)}
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(one, calls))


def _check_cut_answers(answers: list[dict[str, Any]], outcome: Outcome) -> None:
    outcome.notes["answers while cut"] = dict(Counter(f"{a['kind']} {a['status']}" for a in answers))
    outcome.notes["slowest answer while cut (s)"] = round(max(a["s"] for a in answers), 1)
    for a in answers:
        if a["status"] != 503:
            outcome.problem(f"{a['kind']} while cut: {a['status']} after {a['s']:.1f} s: "
                            f"{a.get('body') or a.get('error')}")
            continue
        if not a["retry_after"]:
            outcome.problem(f"{a['kind']} while cut: a 503 without Retry-After")
        try:
            if json.loads(a["body"])["error"]["type"] != "service_unavailable":
                outcome.problem(f"{a['kind']} while cut: a 503 of another type: {a['body']}")
        except (ValueError, KeyError, TypeError):
            outcome.problem(f"{a['kind']} while cut: a 503 that is not an error object: {a['body']}")
        if a["s"] > API_ANSWER_LIMIT_S:
            outcome.problem(f"{a['kind']} while cut: answered after {a['s']:.1f} s, past {API_ANSWER_LIMIT_S:g} s")


def inference_cut(workdir: Path, model: str, env: dict[str, str] | None = None, jobs: int = 4,
                  max_tokens: int = 600, overlap: bool = False) -> Outcome:
    """An inference worker cut off from Redis while it runs jobs, for longer than CLAIM_IDLE_MS; another worker in
    the root namespace takes them over. The heal comes once they have ended or, with `overlap`, while the other
    worker still runs them (the cut-off one comes back to jobs another owns now, mid-run)."""
    outcome = Outcome("inference-overlap" if overlap else "inference")
    body = {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}
    with Scene(workdir, model, env, ["--inference", "0"], "/healthz", "inference") as scene:
        cut_off = scene.start("inference", True, "inference-ns.log")
        cut_id = scene.wait_worker(names.INFERENCE_POOL, cut_off)
        with httpx.Client(base_url=scene.stack.url, timeout=60) as client:
            clean = scene.clean_texts(client, body)
            ids = {accepted_id(client, {**body, "prompt": PROMPTS[i % len(PROMPTS)]}): PROMPTS[i % len(PROMPTS)]
                   for i in range(jobs)}
            outcome.accepted = len(ids)

            def running_there() -> bool:
                recs = [record(scene.r, j) for j in ids]
                return all(rec.get("worker") == cut_id and int(rec.get("completion_tokens") or 0) >= 5 for rec in recs)
            until("every job running on the worker to be cut off", running_there, timeout=120, every=0.01)
            scene.link.cut()  # at once: the tiny model writes hundreds of tokens a second
            tokens_at_cut = {j: int(record(scene.r, j).get("completion_tokens") or 0) for j in ids}
            outcome.notes["tokens at the cut"] = sorted(tokens_at_cut.values())
            if any(r_.get("status") != "running" for r_ in (record(scene.r, j) for j in ids)):
                outcome.problem("a job ended before the cut: longer jobs are needed for this scenario")
            # the other worker starts after the cut: it takes nothing from the fair queue before, and claims the
            # cut-off worker's entries once they are idle past CLAIM_IDLE_MS and its heartbeat has run out
            other = scene.start("inference", False, "inference-root.log")
            other_id = scene.wait_worker(names.INFERENCE_POOL, other)
            monitor: Monitor | None = None
            if overlap:
                def taken_over() -> bool:
                    recs = [record(scene.r, j) for j in ids]
                    return all(rec.get("worker") == other_id and int(rec.get("completion_tokens") or 0)
                               > tokens_at_cut[j] + 5 for j, rec in zip(ids, recs))
                until("the other worker to run every job", taken_over, timeout=120, every=0.01)
                left = [max_tokens - int(record(scene.r, j).get("completion_tokens") or 0) for j in ids]
                outcome.notes["tokens left at the heal"] = sorted(left)
                if min(left) <= 0 or any(record(scene.r, j).get("status") != "running" for j in ids):
                    outcome.problem("a job ended before the heal: longer jobs are needed for this scenario")
                monitor = Monitor(scene.server.url, scene.link.ns_ip)
                scene.link.heal()
            ended = wait_ended(scene.r, list(ids), timeout=240)
            outcome.notes["ended_after_cut_s"] = round(time.time() - scene.link.history[-1 - overlap][1], 1)
            for job_id, prompt in ids.items():
                check_job(client, job_id, ended[job_id], clean[prompt], outcome, max_tokens)
                if ended[job_id].get("worker") != other_id:
                    outcome.problem(f"{job_id} was finished by {ended[job_id].get('worker')}, not the other worker")
            before = {j: snapshot(scene.r, j) for j in ids}
            if not overlap:
                monitor = Monitor(scene.server.url, scene.link.ns_ip)
                scene.link.heal()
            assert monitor is not None
            healed_at = scene.link.history[-1][1]
            outcome.notes["cut_s"] = round(healed_at - scene.link.history[-2][1], 1)
            _finished_and_unchanged(scene, list(ids), names.INFERENCE_POOL, cut_id, healed_at, before, monitor,
                                    outcome)
            def pending() -> int:
                return sum(scene.r.xpending(s_, names.INFERENCE_GROUP)["pending"]
                           for s_ in names.streams(names.TOKENIZED))
            try:  # the entries of ended jobs do not stay pending: each is acknowledged, by whoever holds it last
                until("every tokenized entry to be acknowledged", lambda: pending() == 0, timeout=60, every=0.2)
            except TimeoutError:
                outcome.problem(f"{pending()} tokenized entries still pending a minute after every job ended")
            if cut_off.poll() is not None:
                outcome.problem(f"the cut-off worker exited with {cut_off.returncode}")
    return outcome


def inference_overlap(workdir: Path, model: str, env: dict[str, str] | None = None) -> Outcome:
    """`inference_cut`, healed while the other worker still runs the jobs it took over."""
    return inference_cut(workdir, model, env, max_tokens=1000, overlap=True)


def tokenizer_cut(workdir: Path, model: str, env: dict[str, str] | None = None, jobs: int = 6, max_tokens: int = 40,
                  tries: int = 3) -> Outcome:
    """A tokenizer worker cut off with `jobs` entries delivered to it; another, in the root namespace, claims them."""
    outcome = Outcome("tokenizer")
    body = {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}
    with Scene(workdir, model, env, ["--tokenizers", "0"], "/healthz", "tokenizer") as scene:
        cut_off = scene.start("tokenizer", True, "tokenizer-ns.log")
        cut_id = scene.wait_worker(names.TOKENIZER_POOL, cut_off)
        arrivals = names.fair_key(0, "arrivals")
        jobs_stream = names.stream(names.JOBS, 0)
        with httpx.Client(base_url=scene.stack.url, timeout=60) as client:
            clean = scene.clean_texts(client, body)
            held: list[str] = []
            ids: dict[str, str] = {}
            queued_before = int(scene.r.get(arrivals) or 0)
            for attempt in range(tries):
                # Redis holds the worker's XREADGROUP, blocked; the cut comes while it waits, and the submits after
                # it: Redis answers the read with them, into the cut
                until("the tokenizer to be blocked in its read", lambda: _blocked_reading(scene.r, scene.link.ns_ip),
                      timeout=30, every=0.005)
                scene.link.cut()
                for i in range(jobs):
                    ids[accepted_id(client, {**body, "prompt": PROMPTS[i % len(PROMPTS)]})] = PROMPTS[i % len(PROMPTS)]
                    time.sleep(0.05)
                held = [e["message_id"] for e in scene.r.xpending_range(jobs_stream, names.TOKENIZER_GROUP, "-", "+",
                                                                        100, consumername=cut_id)]
                if held:
                    outcome.notes["attempts"] = attempt + 1
                    break
                # its read had ended before the cut: nothing was delivered to it; again, once it reads again
                scene.link.heal()
                scene.settled(names.TOKENIZER_POOL, cut_id, scene.link.history[-1][1], timeout=120)
            else:
                outcome.problem(f"no entry reached the tokenizer to be cut off in {tries} tries")
                return outcome
            outcome.accepted = len(ids)
            outcome.notes["entries held by the cut-off worker"] = len(held)
            other = scene.start("tokenizer", False, "tokenizer-root.log")
            scene.wait_worker(names.TOKENIZER_POOL, other)
            ended = wait_ended(scene.r, list(ids), timeout=180)
            if not scene.link.is_cut:
                outcome.problem("the link was healed before the jobs ended")
            outcome.notes["ended_after_cut_s"] = round(time.time() - scene.link.history[-1][1], 1)
            for job_id, prompt in ids.items():
                check_job(client, job_id, ended[job_id], clean[prompt], outcome, max_tokens)
            before = {j: snapshot(scene.r, j) for j in ids}
            queued = int(scene.r.get(arrivals) or 0) - queued_before
            monitor = Monitor(scene.server.url, scene.link.ns_ip)
            scene.link.heal()
            healed_at = scene.link.history[-1][1]
            outcome.notes["cut_s"] = round(healed_at - scene.link.history[-2][1], 1)
            _finished_and_unchanged(scene, list(ids), names.TOKENIZER_POOL, cut_id, healed_at, before, monitor,
                                    outcome)
            until("the cut-off tokenizer's entries to be acknowledged",
                  lambda: not scene.r.xpending_range(jobs_stream, names.TOKENIZER_GROUP, "-", "+", 100,
                                                     consumername=cut_id), timeout=60)
            queued_after = int(scene.r.get(arrivals) or 0) - queued_before
            outcome.notes["jobs queued for inference"] = queued_after
            if queued != len(ids) or queued_after != len(ids):
                outcome.duplicated += max(0, queued_after - len(ids))
                outcome.problem(f"{len(ids)} jobs were queued for inference {queued} times by their end and "
                                f"{queued_after} times once the cut-off worker was back")
            if cut_off.poll() is not None:
                outcome.problem(f"the cut-off worker exited with {cut_off.returncode}")
    return outcome


def _blocked_reading(r: redis.Redis, address: str) -> bool:
    return any(c.get("addr", "").rsplit(":", 1)[0] == address and c.get("cmd") == "xreadgroup"
               and "b" in c.get("flags", "") for c in r.client_list())


# ---- a Redis Cluster's master cut off from the majority -----------------------------------------------------------

# the minority side's client, run inside the cut-off master's namespace: SET then WAIT 1 in one round trip on its own
# connection to that master (as conveyor's promises: shared/job_ops.py, execute_copied), one write every 20 ms, each
# outcome a JSON line, until the stop file appears
MINORITY_WRITER = """
import json, sys, time, os
import redis
host, port, password, prefix, out, stop = sys.argv[1:7]
from redis.backoff import NoBackoff
from redis.retry import Retry
c = redis.Redis(host=host, port=int(port), password=password, socket_timeout=1, socket_connect_timeout=1,
                retry=Retry(NoBackoff(), 0))  # one try per write: redis-py's default retries with backoff for 10s
i = 0
with open(out, "a") as f:
    while not os.path.exists(stop):
        key = f"{prefix}:{i}"
        t = time.time()
        try:
            p = c.pipeline(transaction=False)
            p.set(key, str(i))
            p.execute_command("WAIT", 1, 200)
            got = p.execute(raise_on_error=False)
            row = {"i": i, "key": key, "t": t, "set": got[0] is True, "copies": got[1] if isinstance(got[1], int)
                   else None, "error": next((f"{type(g).__name__}: {g}"[:120] for g in got if isinstance(g, Exception)),
                                            None)}
        except redis.RedisError as e:
            row = {"i": i, "key": key, "t": t, "set": False, "copies": None, "error": f"{type(e).__name__}: {e}"[:120]}
        row["end"] = time.time()
        f.write(json.dumps(row) + "\\n")
        f.flush()
        i += 1
        time.sleep(0.02)
"""


class NsClusterNode(ClusterNode):
    """A LocalCluster node bound to and announcing `host` (not 127.0.0.1), run inside `ns` when given."""

    def __init__(self, *args: Any, host: str, ns: netns.Namespace | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.host, self.ns = host, ns

    def write_config(self) -> Path:
        path = super().write_config()
        with open(path, "a") as f:  # (later lines win)
            binds = self.host if self.ns is not None else f"127.0.0.1 {self.host}"
            # its own connections (cluster bus, replication) from `host`: the kernel's choice for one started
            # during a cut (the sink route has no source) is another address, which the namespace cannot answer
            # once healed, and a bus link stuck so keeps a healed node flagged as failing (its FAIL is cleared
            # only by a PONG on that link)
            f.write(f"bind {binds}\ncluster-announce-ip {self.host}\nbind-source-addr {self.host}\n")
        return path

    def command(self) -> list[str]:
        return self.ns.command(super().command()) if self.ns is not None else super().command()

    @property
    def url(self) -> str:
        return f"redis://:{quote(self.password, safe='')}@{self.host}:{self.port}/0"

    def client(self, timeout: float = 2.0) -> redis.Redis:
        return redis.Redis(host=self.host, port=self.port, password=self.password, socket_timeout=timeout,
                           socket_connect_timeout=timeout, decode_responses=True)


class NsCluster(LocalCluster):
    """A LocalCluster whose first node runs inside `ns` on the link's namespace side (listed first to
    `--cluster create`, which makes it a master), the others in the root namespace on the link's root side: cutting
    the link cuts that one node off from all the others."""

    def __init__(self, data_dir: Path, link: netns.Link, ns: netns.Namespace, node_timeout_ms: int = 2000) -> None:
        self.link, self.ns, self._made = link, ns, 0
        super().__init__(data_dir, masters=3, replicas=1, node_timeout_ms=node_timeout_ms)

    def _node(self, port: int, cluster_port: int) -> ClusterNode:
        inside = self._made == 0
        self._made += 1
        return NsClusterNode(self.data_dir / str(port), port, cluster_port, self.password, self.appendfsync,
                             self.maxmemory_mb, self.node_timeout_ms, self.die_with_parent,
                             host=self.link.ns_ip if inside else self.link.host_ip, ns=self.ns if inside else None)

    @property
    def cut_node(self) -> NsClusterNode:
        return self.nodes[0]  # type: ignore[return-value]

    @property
    def url(self) -> str:
        n = self.nodes[1]
        return f"redis://:{quote(self.password, safe='')}@{n.host}:{n.port}/0"  # type: ignore[attr-defined]

    def _create(self, cli: str, deadline: float) -> None:
        args = [cli, "--no-auth-warning", "--cluster", "create",
                *(f"{n.host}:{n.port}" for n in self.nodes),  # type: ignore[attr-defined]
                "--cluster-replicas", str(self.replicas), "--cluster-yes"]
        done = subprocess.run(args, env={**os.environ, "REDISCLI_AUTH": self.password}, capture_output=True,
                              text=True, timeout=max(1.0, deadline - time.monotonic()))
        if done.returncode != 0 or "[OK] All 16384 slots covered" not in done.stdout:
            raise RuntimeError(f"redis-cli --cluster create failed ({done.returncode}):\n{done.stdout[-2000:]}"
                               f"{done.stderr[-2000:]}")

    def view(self, port: int) -> list[Any]:
        """CLUSTER NODES as node `port` sees it."""
        with self.node(port).client() as c:
            return _parse_nodes(c.execute_command("CLUSTER", "NODES"))

    def slot_owner(self, slot: int, asking: int) -> NsClusterNode | None:
        """The master serving `slot`, as node `asking` sees it."""
        for e in self.view(asking):
            if "master" in e.flags and not e.failing() and any(_in_range(slot, r) for r in e.slots):
                return self.node(e.port)  # type: ignore[return-value]
        return None


def _in_range(slot: int, spec: str) -> bool:
    if spec.startswith("["):
        return False  # a slot being migrated
    lo, _, hi = spec.partition("-")
    return int(lo) <= slot <= int(hi or lo)


def _tag_in(cluster: NsCluster, port: int, asking: int) -> str:
    """A hash tag whose slot node `port` serves."""
    for i in range(100_000):
        tag = f"{{p{i}}}"
        owner = cluster.slot_owner(key_slot(tag.encode()), asking)
        if owner is not None and owner.port == port:
            return tag
    raise RuntimeError(f"no hash tag found on node {port}")


class MajorityWriter(threading.Thread):
    """The majority side's client, in the root namespace: for each hash tag, SET then WAIT 1 on the slot's master as
    a root-namespace node sees it (found again after any error), one write per tag every 20 ms."""

    def __init__(self, cluster: NsCluster, tags: dict[str, str], asking: int) -> None:
        super().__init__(name="majority-writer", daemon=True)
        self.cluster, self.tags, self.asking = cluster, tags, asking
        self.rows: list[dict[str, Any]] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        owners: dict[str, NsClusterNode | None] = {}
        i = 0
        while not self.stopping.is_set():
            for label, tag in self.tags.items():
                key, t = f"{tag}:majority:{label}:{i}", time.time()
                row: dict[str, Any] = {"i": i, "key": key, "tag": label, "t": t, "set": False, "copies": None,
                                       "error": None}
                try:
                    if owners.get(tag) is None:
                        owners[tag] = self.cluster.slot_owner(key_slot(tag.encode()), self.asking)
                    node = owners[tag]
                    if node is None:
                        raise redis.ConnectionError("no master serves the slot")
                    with redis.Redis(host=node.host, port=node.port, password=node.password, socket_timeout=1,
                                     socket_connect_timeout=1, retry=Retry(NoBackoff(), 0)) as c:
                        pipe = c.pipeline(transaction=False)
                        pipe.set(key, str(i))
                        pipe.execute_command("WAIT", 1, 200)
                        got = pipe.execute(raise_on_error=False)
                    row.update({"set": got[0] is True, "copies": got[1] if isinstance(got[1], int) else None,
                                "error": next((_error(g) for g in got if isinstance(g, Exception)), None)})
                    if row["error"]:
                        owners[tag] = None
                except (redis.RedisError, OSError) as e:
                    row["error"] = _error(e)
                    owners[tag] = None
                row["end"] = time.time()
                self.rows.append(row)
            i += 1
            self.stopping.wait(0.02)


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:120]


def cluster_cut(workdir: Path, model: str = "", env: dict[str, str] | None = None, min_replicas: int = 1,
                max_lag_s: int = 1, node_timeout_ms: int = 2000) -> Outcome:
    """A master of a local Redis Cluster (3 masters, 3 replicas), alone in its namespace with a client of its own,
    cut off from the majority (the other nodes and a client in the root namespace) until the majority has failed
    it over, then healed. `min_replicas` and `max_lag_s`: every node's min-replicas-to-write and
    min-replicas-max-lag. (`model` and `env` are unused: no stack runs here.)"""
    outcome = Outcome("cluster")
    workdir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as exits:
        lab = exits.enter_context(netns.NetLab())
        ns = lab.namespace("cluster-m")
        link = ns.link()
        cluster = NsCluster(workdir / "cluster", link, ns, node_timeout_ms)
        cluster.start()
        exits.callback(cluster.stop)
        exits.callback(lambda: link.heal() if link.is_cut else None)
        for n in cluster.nodes:
            with n.client() as c:
                c.config_set("min-replicas-to-write", min_replicas)
                c.config_set("min-replicas-max-lag", max_lag_s)
        cut, asking = cluster.cut_node, cluster.nodes[1].port
        masters = cluster.master_ports()
        if cut.port not in masters:
            raise RuntimeError(f"the node in the namespace ({cut.port}) is not a master: {masters}")
        def replica_of_cut() -> int | None:
            view = cluster.view(asking)
            ids = [e.id for e in view if e.port == cut.port]
            return next((e.port for e in view if ids and e.master_id == ids[0] and not e.failing()), None)
        try:
            replica = until("the cut-off master's replica", replica_of_cut, timeout=30, every=0.1)
        except TimeoutError as e:
            raise RuntimeError(f"{e}: {[(x.port, x.flags, x.master_id) for x in cluster.view(asking)]}") from None
        other_master = next(p for p in masters if p != cut.port)
        tags = {"cut": _tag_in(cluster, cut.port, asking), "other": _tag_in(cluster, other_master, asking)}
        out, stop_file = workdir / "minority.jsonl", workdir / "minority.stop"
        minority = spawn([sys.executable, "-c", MINORITY_WRITER, cut.host, str(cut.port), cut.password,
                          f"{tags['cut']}:minority", str(out), str(stop_file)], os.environ.copy(),
                         workdir / "minority.log", ns)
        exits.callback(stop, minority)
        exits.callback(stop_file.touch)
        majority = MajorityWriter(cluster, tags, asking)
        majority.start()
        exits.callback(majority.stopping.set)

        def rows() -> list[dict[str, Any]]:
            try:
                return [json.loads(line) for line in out.read_text().splitlines() if line.endswith("}")]
            except OSError:
                return []
        acked = lambda rs: [r for r in rs if r["set"] and (r["copies"] or 0) >= 1]  # noqa: E731
        until("both sides' writes to be acknowledged", lambda: len(acked(rows())) >= 20
              and len(acked(majority.rows)) >= 20, timeout=60)
        link.cut()
        cut_at = link.history[-1][1]

        def failed_over() -> bool:
            view = cluster.view(asking)
            return any(e.port == replica and "master" in e.flags for e in view) and \
                any(e.port == cut.port and e.failing() for e in view)
        until("the majority to fail the cut-off master over", failed_over, timeout=60, every=0.1)
        failover_s = time.time() - cut_at
        until("the minority's client to be refused", lambda: any(r["t"] > cut_at and not r["set"] for r in rows()),
              timeout=30, every=0.1)
        during = lambda: [r for r in majority.rows if r["t"] > cut_at + failover_s]  # noqa: E731
        until("the majority's client to try the failed-over slots", lambda: len(during()) >= 40, timeout=30)
        link.heal()
        healed_at = link.history[-1][1]

        def rejoined() -> bool:
            try:
                with cut.client() as c:
                    info = c.info("replication")
                return info.get("role") == "slave" and info.get("master_link_status") == "up"
            except redis.RedisError:
                return False
        until("the cut-off master to rejoin as a replica", rejoined, timeout=90, every=0.2)
        cluster.wait_ok(timeout=60)
        until("the majority's writes to the cut-off master's slots to be acknowledged again",
              lambda: len([r for r in acked(majority.rows) if r["tag"] == "cut" and r["t"] > healed_at]) >= 10,
              timeout=60)
        majority.stopping.set()
        majority.join(10)
        stop_file.touch()
        minority.wait(10)
        minority_rows, majority_rows = rows(), list(majority.rows)
        (workdir / "majority.jsonl").write_text("".join(json.dumps(r) + "\n" for r in majority_rows))
        (workdir / "timeline.json").write_text(json.dumps({"cut": cut_at, "failed_over": cut_at + failover_s,
                                                           "healed": healed_at}))

        # every write acknowledged (its SET done and a replica's copy confirmed), on either side, is still there
        def value(key: str) -> str | None:
            owner = cluster.slot_owner(key_slot(key.encode()), asking)
            assert owner is not None
            with owner.client() as c:
                return c.get(key)  # type: ignore[return-value]
        both = minority_rows + majority_rows
        outcome.accepted = len(acked(both))
        for r in acked(both):
            got = value(r["key"])
            if got != str(r["i"]):
                outcome.lost += 1
                outcome.problem(f"acknowledged write {r['key']} (at {r['t'] - cut_at:+.2f} s from the cut) reads "
                                f"{got!r} after the heal")
        # the minority side: refused once its writes can no longer be copied; what it accepted meanwhile, uncopied,
        # is what a failover may drop (and did: the rejoined master took its replica's data)
        # (answered while cut: a write sent just before the heal may be copied just after it)
        after_cut = [r for r in minority_rows if cut_at < r["t"] and r["end"] < healed_at]
        # (a write the client gave up on, its socket timing out while the WAIT blocked, was not refused by Redis)
        refused = [r for r in after_cut if not r["set"] and not (r.get("error") or "").startswith("TimeoutError")]
        first_refusal = min(r["t"] for r in refused) - cut_at if refused else None
        uncopied = [r for r in after_cut if r["set"] and not (r["copies"] or 0)]
        late = [r for r in uncopied if first_refusal is not None and r["t"] - cut_at > first_refusal]
        bound = max(max_lag_s if min_replicas else 0, node_timeout_ms / 1000) + 2.5
        if any(r["set"] and (r["copies"] or 0) >= 1 for r in after_cut):
            outcome.problem("the cut-off master's client had a write copied while cut")
        if first_refusal is None or first_refusal > bound:
            outcome.problem(f"the minority side's writes were first refused {first_refusal} s after the cut, "
                            f"past {bound:g} s")
        if late:
            outcome.problem(f"the minority side accepted {len(late)} writes after its first refusal")
        survived = sum(value(r["key"]) == str(r["i"]) for r in uncopied)
        maj_cut = [r for r in majority_rows if r["tag"] == "cut" and cut_at < r["t"] and r["end"] < healed_at]
        maj_other = [r for r in majority_rows if r["tag"] == "other" and cut_at < r["t"] and r["end"] < healed_at]
        outcome.notes.update({
            "cut_s": round(healed_at - cut_at, 1), "failover_after_cut_s": round(failover_s, 1),
            "minority: first refusal after the cut (s)": None if first_refusal is None else round(first_refusal, 2),
            "minority: refusals": dict(Counter(re.sub(r"\d+", "N", r["error"] or "")[:60] for r in refused)),
            "minority: accepted but never copied (may be lost)": len(uncopied),
            "minority: of those, still there after the heal": survived,
            "majority: cut-off master's slots while cut, acknowledged / tried":
                f"{len(acked(maj_cut))} / {len(maj_cut)}",
            "majority: refusals there": dict(Counter(re.sub(r"\d+", "N", r["error"] or "no copy")[:60]
                                                     for r in maj_cut if r not in acked(maj_cut))),
            "majority: other slots while cut, acknowledged / tried": f"{len(acked(maj_other))} / {len(maj_other)}",
            "majority: refusals on other slots": dict(Counter(re.sub(r"\d+", "N", r["error"] or "no copy")[:60]
                                                          for r in maj_other if r not in acked(maj_other))),
            "min-replicas-to-write / max-lag / node timeout": f"{min_replicas} / {max_lag_s} s / {node_timeout_ms} ms",
        })
    return outcome


SCENARIOS: dict[str, Callable[..., Outcome]] = {"api": api_cut, "inference": inference_cut,
                                              "inference-overlap": inference_overlap, "tokenizer": tokenizer_cut,
                                              "cluster": cluster_cut}

