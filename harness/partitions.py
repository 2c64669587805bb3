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

Greedy float32 decoding on a model of the caller's (the tiny model in the tests) gives every job with the same
prompt the same text, whichever worker runs or resumes it, which is what "the clean run's text" relies on.
"""

from __future__ import annotations

import contextlib
import json
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
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
import redis

from harness import netns
from harness.sse import check_events, read_events, tokens_text
from harness.stack import ROOT, Stack, start_stack, stop_stack, wait_http
from infra.redis_server import RedisServer, free_port
from shared import names
from shared.jobs import TERMINAL
from shared.lifecycle import preexec_die_with_parent

# fast redelivery and heartbeats, float32 greedy (the suite's TEST_ENV, for callers that bring none)
ENV = {"CLAIM_IDLE_MS": "3000", "REFRESH_S": "0.5", "HEARTBEAT_S": "1", "MAX_MODEL_LEN": "1024",
       "MAX_TOKENS_CAP": "1000", "DRAIN_GRACE_S": "10", "LOG_LEVEL": "WARNING", "DTYPE": "float32"}
# the longest a request to the cut-off API may take: one Redis call's read timeout (socket_timeout 10 s), its one
# retry on a new connection (connect timeout 2 s) and the pool's wait (10 s) are the API's own bounds (shared/
# redis_client.py, async_client); a little over twice one call's, for a handler that makes two before it fails
API_ANSWER_LIMIT_S = 25.0
PROMPTS = [f"Story number {i}:" for i in range(4)]
T = TypeVar("T")


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

    def config(self) -> dict[str, str]:
        return {**super().config(), "bind": f"127.0.0.1 {self.also_bind}"}

    def url_at(self, host: str) -> str:
        return f"redis://:{quote(self.password, safe='')}@{host}:{self.port}/0"


# ---- the pieces each scenario uses -------------------------------------------------------------------------------


def until(what: str, condition: Callable[[], T], timeout: float, every: float = 0.05) -> T:
    """The first truthy value of `condition()`; TimeoutError naming `what` once `timeout` has passed."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)


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

    def counts(self) -> dict[str, int]:
        """The watched clients' write commands by name (scripts' under their call's name)."""
        return dict(Counter(f"{args[0].lower()}" + (f" in {via}" if via != "direct" else "")
                            for _, via, args in self.lines if args[0].lower() in self.WRITES))


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
    """After the heal, once the cut-off worker is back: nothing of the finished jobs changed, and it wrote nothing
    into them."""
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
    outcome.notes["returning worker's writes into finished jobs"] = len(writes)
    outcome.notes["returning worker's writes"] = monitor.counts()
    if writes:
        shown = Counter(re.sub(r"job_[0-9a-f]+", "job_…", w) for w in writes)
        outcome.problem(f"the returning {pool} worker wrote {len(writes)} times into finished jobs: "
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
                  max_tokens: int = 600) -> Outcome:
    """An inference worker cut off from Redis while it runs jobs, for longer than CLAIM_IDLE_MS; another worker in
    the root namespace takes them over."""
    outcome = Outcome("inference")
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
            until("every job running on the worker to be cut off", running_there, timeout=120)
            other = scene.start("inference", False, "inference-root.log")
            other_id = scene.wait_worker(names.INFERENCE_POOL, other)
            tokens_at_cut = {j: int(record(scene.r, j).get("completion_tokens") or 0) for j in ids}
            outcome.notes["tokens at the cut"] = sorted(tokens_at_cut.values())
            if any(r_.get("status") != "running" for r_ in (record(scene.r, j) for j in ids)):
                outcome.problem("a job ended before the cut: longer jobs are needed for this scenario")
            scene.link.cut()
            ended = wait_ended(scene.r, list(ids), timeout=240)
            outcome.notes["ended_after_cut_s"] = round(time.time() - scene.link.history[-1][1], 1)
            for job_id, prompt in ids.items():
                check_job(client, job_id, ended[job_id], clean[prompt], outcome, max_tokens)
                if ended[job_id].get("worker") != other_id:
                    outcome.problem(f"{job_id} was finished by {ended[job_id].get('worker')}, not the other worker")
            before = {j: snapshot(scene.r, j) for j in ids}
            monitor = Monitor(scene.server.url, scene.link.ns_ip)
            scene.link.heal()
            healed_at = scene.link.history[-1][1]
            outcome.notes["cut_s"] = round(healed_at - scene.link.history[-2][1], 1)
            _finished_and_unchanged(scene, list(ids), names.INFERENCE_POOL, cut_id, healed_at, before, monitor,
                                    outcome)
            if cut_off.poll() is not None:
                outcome.problem(f"the cut-off worker exited with {cut_off.returncode}")
    return outcome


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
            fair = {k: v for k, v in monitor.counts().items() if "fair_push" in k or k.startswith("zadd")}
            if fair:
                outcome.notes["returning tokenizer's fair-queue writes"] = fair
            if cut_off.poll() is not None:
                outcome.problem(f"the cut-off worker exited with {cut_off.returncode}")
    return outcome


def _blocked_reading(r: redis.Redis, address: str) -> bool:
    return any(c.get("addr", "").rsplit(":", 1)[0] == address and c.get("cmd") == "xreadgroup"
               and "b" in c.get("flags", "") for c in r.client_list())


SCENARIOS: dict[str, Callable[..., Outcome]] = {"api": api_cut, "inference": inference_cut, "tokenizer": tokenizer_cut}

