"""Failover chaos: kill -9 of a Redis Cluster master under load, many rounds in a row on one stack.

    .venv/bin/python -m bench faults failover                      # 20 rounds, 30 greedy jobs each, default model
    .venv/bin/python -m bench faults failover --rounds 3 --tiny    # a short one on a tiny random model
    .venv/bin/python -m bench faults failover --seeds all          # REDIS_URL lists every node
    .venv/bin/python -m bench faults failover --fault pause-replica --rounds 5 --tiny   # a replica paused instead
    .venv/bin/python -m bench faults failover --fault pause-master --tiny   # a master paused (silent), not killed
    .venv/bin/python -m bench faults failover --fault refuse-writes --tiny  # a master refusing writes for a while
    .venv/bin/python -m bench faults failover --fault lost-end --tiny       # ends no replica had, lost with the master

The README's cluster settings on a cluster of its own, as an operator runs one (not the supervisor's, which
would start a killed node again at once): a LocalCluster of 3 masters and 3 replicas, a single-node Redis as
Celery's broker, and `conveyor up` with REDIS_URL naming one node (`--seeds one`, the default) or every node
(`--seeds all`), REDIS_PARTITIONS=12 and fast redelivery. Each round submits --jobs greedy jobs (each with an
Idempotency-Key; a 503 is retried with the same key), and right after the last 202 kills -9 one master: in
even rounds one that is not the node REDIS_URL names first, in odd rounds that node itself (when it is a
master); a third as many jobs again are submitted through the failover. Once its replica has taken over,
the node starts again and rejoins as a replica, as an operator's restart would. A round passes when
every accepted job ends succeeded with the text of a clean run and an event stream of seqs 1..n that joins
to it; a round in which some job has not ended DRAIN_S after the kill is a stall. Exit status 1 if any round
failed.

`--fault pause-master`: the master is paused (SIGSTOP) rather than killed: silent, its connections open, as a
node cut off by the network is; once its replica has taken over, it runs again and finds itself a replica. Every
job accepted before the pause is streamed too: the row adds the longest gap between two token events of a stream,
and of a stream whose job another master holds (`gap_elsewhere_s`: its output need not wait for the paused one).
For kill and pause-master, `ttft_elsewhere_s` is the longest wait for a first token (from the job's creation) of the
jobs submitted through the fault whose partitions other masters hold, `submit_elsewhere_s` the longest of their
submits (POST to 202: the API's share), and `start_elsewhere_s` the longest from creation to a worker's start
(tokenizing, the fair queue, the pop: admission's share).

`--fault pause-replica`: each round streams --jobs jobs of staggered lengths (so that some end all the time) and,
once every one has its first token, pauses one replica (SIGSTOP: connected, silent, as one cut off or stuck) of a
master that REDIS_URL does not name for PAUSE_S, then lets it run. Jobs ending on its master wait for it (their
ends are Done only once a replica has them, or after 5 s without one); the others' output must not. The row gives
the longest gap between two token events of any stream while the replica was paused; a round passes when every
job ends succeeded, its event stream whole.

`--fault refuse-writes`: as `pause-replica`, but a master (not the node REDIS_URL names) refuses every write for
PAUSE_S (`min-replicas-to-write` above its replicas: NOREPLICAS; a failed save on a full disk, MISCONF, is the
same to the stack), then takes writes again. Its jobs pause: every loop backs off as in an outage. A round passes
when every job ends succeeded, its event stream whole, and no process of the stack was restarted.

`--fault lost-end`: jobs end on a master that no replica follows, and the master dies: each round submits --jobs
jobs, waits until every job on one master (not the node REDIS_URL names) runs, then cuts that master's replica off
(SIGSTOP, its replication link killed), so that the ends written meanwhile reach no replica (the output lane's fence
finds none connected and lets them through: availability over the copy). Once every such job reads ended, the master
is killed -9 and its replica, running again, takes over without those ends: the records say running and the
entries are pending for the worker that ran them, which takes them up again. A round passes when every accepted job
ends (again) succeeded with the text of a clean run (the seed promise: a job's seed comes from its id when it names
none) and an event stream of seqs 1..n that joins to it; `ran_again` counts the jobs read ended before the kill
and running after it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import queue
import signal
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import redis.cluster

from bench.common import PROMPTS, default_model, make_tiny_model, md_table, parser
from harness.sse import check_events, iter_sse, read_events
from harness.stack import Stack, start_stack, stop_stack, until
from infra.redis_cluster import LocalCluster
from infra.redis_server import RedisServer
from shared import names
from shared.jobs import STAGE_FIELDS, TERMINAL, stages

ENV = {"CLAIM_IDLE_MS": "3000", "REFRESH_S": "0.5", "HEARTBEAT_S": "1", "LOG_LEVEL": "WARNING",
       "REDIS_PARTITIONS": "12"}  # the default dtype: texts compare exactly across batches in either (invariance)
DRAIN_S = 180.0
PAUSE_S = 8.0


def body(i: int, max_tokens: int) -> dict[str, Any]:
    return {"prompt": PROMPTS[i % 5], "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}


def submit(client: httpx.Client, payload: dict[str, Any], counts: dict[str, int]) -> str | None:
    """The job's id once answered 202, retried with the same Idempotency-Key through 503s and resets."""
    key = uuid.uuid4().hex
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            r = client.post("/v1/jobs", json=payload, headers={"Idempotency-Key": key})
        except httpx.TransportError:
            counts["transport"] += 1
        else:
            if r.status_code == 202:
                return str(r.json()["id"])
            if r.status_code != 503:
                raise RuntimeError(f"submit answered {r.status_code}: {r.text[:300]}")
            counts["503"] += 1
        time.sleep(0.3)
    return None


class Streams:
    """Each job's event stream (SSE) read in a thread of its own: its events, and when each token event came."""

    def __init__(self, client: httpx.Client, job_ids: list[str]) -> None:
        self.arrivals: dict[str, list[float]] = {j: [] for j in job_ids}
        self.events: dict[str, list[dict[str, Any]]] = {}
        self.threads = [threading.Thread(target=self._read, args=(client, j), daemon=True) for j in job_ids]
        for t in self.threads:
            t.start()

    def _read(self, client: httpx.Client, job_id: str) -> None:
        events: list[dict[str, Any]] = []
        with client.stream("GET", f"/v1/jobs/{job_id}/events", timeout=DRAIN_S) as resp:
            for ev in iter_sse(resp):
                if ev.get("event") == "token":
                    self.arrivals[job_id].append(time.monotonic())
                if ev.get("event") != "status":
                    events.append(ev)
                if ev.get("event") in ("done", "error"):
                    break
        self.events[job_id] = events

    def started(self) -> bool:
        return all(self.arrivals.values())

    def join(self) -> None:
        for t in self.threads:
            t.join(DRAIN_S)

    def gaps(self, since: float, until_: float, jobs: set[str] | None = None) -> list[float]:
        """The gaps between two token events of a stream (of `jobs`, else any) that overlap [since, until_]."""
        return [b - a for job_id, times in self.arrivals.items() if jobs is None or job_id in jobs
                for a, b in zip(times, times[1:]) if b > since and a < until_]


def partitions_of(cluster: LocalCluster, master: int) -> set[int]:
    """The partitions whose records `master` holds now: read before the fault (a failover moves them)."""
    client = redis.cluster.RedisCluster.from_url(cluster.url)
    try:
        with names.partitions_as(int(ENV["REDIS_PARTITIONS"])):  # (the stack's, not this process's)
            return {p for p in names.partitions()
                    if client.get_node_from_key(names.job_key(names.job_id_in(p, "0" * 30))).port == master}
    finally:
        client.close()


def elsewhere(jobs: list[str], held: set[int]) -> set[str]:
    """The jobs whose partitions are not among `held` (those of the master at fault)."""
    with names.partitions_as(int(ENV["REDIS_PARTITIONS"])):
        return {j for j in jobs if names.job_partition(j) not in held}


class Reviver(threading.Thread):
    """As an operator's restart would: once a killed master's replica has taken over, the node starts again
    and rejoins as a replica (until then its new master has none, and the writes it is to promise are
    refused: 503). One thread for the whole run: a node dies with the thread that started it."""

    def __init__(self, cluster: LocalCluster) -> None:
        super().__init__(name="reviver", daemon=True)
        self.cluster = cluster
        self.asked: queue.SimpleQueue[tuple[int, bool, threading.Event]] = queue.SimpleQueue()

    def revive(self, port: int, paused: bool = False) -> threading.Event:
        done = threading.Event()
        self.asked.put((port, paused, done))
        return done

    def run(self) -> None:
        while True:
            port, paused, done = self.asked.get()
            with contextlib.suppress(TimeoutError):  # (the dead node is not counted): until its replica is promoted
                until("a replica promoted", functools.partial(self._promoted, port), 60, every=0.2)
            if paused:
                self.cluster.kill(port, signal.SIGCONT)
            else:
                self.cluster.restart_node(port)
            done.set()

    def _promoted(self, port: int) -> bool:
        return len([p for p in self.cluster.master_ports() if p != port]) >= self.cluster.masters


def count_wrong(client: httpx.Client, ended: dict[str, dict[str, Any]], accepted: dict[str, int],
                clean: dict[int, str]) -> int:
    """The ended jobs that did not succeed with their clean text and an event stream of seqs 1..n joining to it,
    each printed."""
    wrong = 0
    for job_id, job in ended.items():
        events = check_events(read_events(client, job_id), job["text"])
        if job["status"] != "succeeded" or job["text"] != clean[accepted[job_id] % 5] or events is not None:
            wrong += 1
            print(json.dumps({"wrong": job_id, "status": job["status"], "error": job.get("error"),
                              "events": events, "text": job["text"], "clean": clean[accepted[job_id] % 5]}),
                  flush=True)
    return wrong


def one_round(stack: Stack, cluster: LocalCluster, reviver: Reviver, rnd: int, args: argparse.Namespace,
              clean: dict[int, str]) -> dict[str, Any]:
    counts = {"503": 0, "transport": 0}
    seed = cluster.nodes[0].port
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        accepted = {}
        for i in range(args.jobs):
            job_id = submit(client, body(i, args.max_tokens), counts)
            if job_id:
                accepted[job_id] = i
        live = cluster.master_ports()
        target = seed if rnd % 2 == 1 and seed in live else next(p for p in live if p != seed)
        paused = args.fault == "pause-master"
        streams = Streams(client, list(accepted)) if paused else None  # what a streaming client sees meanwhile
        held = partitions_of(cluster, target)
        others = elsewhere(list(accepted), held)
        cluster.kill(target, signal.SIGSTOP if paused else signal.SIGKILL)
        killed_at = time.monotonic()
        revived = reviver.revive(target, paused)
        through: list[str] = []
        answered_in: dict[str, float] = {}  # how long each took to be answered 202 (503s retried)
        for i in range(args.jobs, args.jobs + args.jobs // 3):  # and more through the failover: 503s, then 202s
            asked = time.monotonic()
            job_id = submit(client, body(i, args.max_tokens), counts)
            if job_id:
                accepted[job_id] = i
                through.append(job_id)
                answered_in[job_id] = time.monotonic() - asked
        ended: dict[str, dict[str, Any]] = {}
        slowest_poll = 0.0
        while len(ended) < len(accepted) and time.monotonic() - killed_at < DRAIN_S:
            for job_id in [j for j in accepted if j not in ended]:
                asked = time.monotonic()
                try:
                    r = client.get(f"/v1/jobs/{job_id}")
                except httpx.TransportError:
                    continue
                finally:
                    slowest_poll = max(slowest_poll, time.monotonic() - asked)
                if r.status_code == 200 and r.json()["status"] in TERMINAL:
                    ended[job_id] = r.json()
            time.sleep(0.5)
        drained_s = time.monotonic() - killed_at
        # how long the jobs accepted through the failover, on the other masters, waited for their first token
        through_elsewhere = elsewhere(through, held)
        slowest = max((j for j in through_elsewhere if j in ended and ended[j].get("first_token_at")), default=None,
                      key=lambda j: ended[j]["first_token_at"] - ended[j]["created_at"])
        if slowest is not None:  # where its wait went, stage by stage (the record's times, written at its end)
            with redis.cluster.RedisCluster.from_url(cluster.url, decode_responses=True) as rc, \
                    names.partitions_as(int(ENV["REDIS_PARTITIONS"])):
                times = rc.hmget(names.job_key(slowest), list(STAGE_FIELDS))
            spans = {s["stage"]: round(s["end"] - s["start"], 2) for s in stages(dict(zip(STAGE_FIELDS, times)))}
            print(json.dumps({"slowest_elsewhere": slowest, **spans}), flush=True)
        ttfts = [ended[j]["first_token_at"] - ended[j]["created_at"] for j in through_elsewhere
                 if j in ended and ended[j].get("first_token_at")]
        gap = gap_elsewhere = 0.0
        if streams is not None:
            streams.join()
            gap = max(streams.gaps(killed_at, killed_at + drained_s), default=0.0)
            gap_elsewhere = max(streams.gaps(killed_at, killed_at + drained_s, others), default=0.0)
        wrong = count_wrong(client, ended, accepted, clean)
    revived.wait(90)
    healed = True
    try:
        cluster.wait_ok(timeout=60)
    except Exception:  # noqa: BLE001 - reported in the row
        healed = False
    lost = len(accepted) - len(ended)
    return {"round": rnd + 1, "killed": "seed" if target == seed else "other", "accepted": len(accepted),
            "lost": lost, "wrong": wrong, "stalled": lost > 0, "drained_s": round(drained_s, 1),
            "503s": counts["503"], "healed": healed, "longest_gap_s": round(gap, 2),
            "gap_elsewhere_s": round(gap_elsewhere, 2), "slowest_poll_s": round(slowest_poll, 2),
            "ttft_elsewhere_s": round(max(ttfts, default=0.0), 2),
            "submit_elsewhere_s": round(max((answered_in[j] for j in through_elsewhere), default=0.0), 2),
            "start_elsewhere_s": round(max((ended[j]["started_at"] - ended[j]["created_at"] for j in through_elsewhere
                                            if j in ended and ended[j].get("started_at")), default=0.0), 2)}


def pause_round(stack: Stack, cluster: LocalCluster, rnd: int, args: argparse.Namespace) -> dict[str, Any]:
    """`--fault pause-replica`: one replica paused for PAUSE_S under streams that end all through the pause;
    `--fault refuse-writes`: one master refusing writes for PAUSE_S instead."""
    counts = {"503": 0, "transport": 0}
    pids = {p.pid for _, p in stack.tree()}
    with httpx.Client(base_url=stack.url, timeout=30, limits=httpx.Limits(max_connections=args.jobs + 4)) as client:
        jobs = [submit(client, body(i, args.max_tokens + 24 * i), counts) for i in range(args.jobs)]
        streams = Streams(client, [j for j in jobs if j])
        until("every job's first token", streams.started, 60, every=0.02)
        seed = cluster.nodes[0].port
        master = next(p for p in cluster.master_ports() if p != seed)
        replica = cluster.replica_of(master)
        node = cluster.node(master).client()
        others = elsewhere([j for j in jobs if j], partitions_of(cluster, master))
        refused = _refusals(node)
        if args.fault == "refuse-writes":
            node.config_set("min-replicas-to-write", len(cluster.replica_ports()) + 1)
        else:
            cluster.kill(replica, signal.SIGSTOP)
        paused_at = time.monotonic()
        time.sleep(PAUSE_S)
        resumed_at = time.monotonic()
        if args.fault == "refuse-writes":
            refused = _refusals(node) - refused
            node.config_set("min-replicas-to-write", 0)
        else:
            cluster.kill(replica, signal.SIGCONT)
        node.close()
        streams.join()
        gaps = streams.gaps(paused_at, resumed_at)
        gaps_elsewhere = streams.gaps(paused_at, resumed_at, others)
        wrong = 0
        for job_id in (j for j in jobs if j):
            job = client.get(f"/v1/jobs/{job_id}").json()
            if job["status"] != "succeeded" or check_events(streams.events.get(job_id, []), job["text"]) is not None:
                wrong += 1
    cluster.wait_ok(timeout=60)
    accepted = sum(1 for j in jobs if j)
    return {"round": rnd + 1, "accepted": accepted, "lost": accepted - len(streams.events), "wrong": wrong,
            "ended_in_pause": sum(1 for t in streams.arrivals.values() if t and paused_at < t[-1] < resumed_at),
            "longest_gap_s": round(max(gaps, default=0.0), 2), "gaps_over_1s": sum(1 for g in gaps if g > 1.0),
            "gap_elsewhere_s": round(max(gaps_elsewhere, default=0.0), 2),
            "refusals": refused if args.fault == "refuse-writes" else None,
            "restarted": len(pids - {p.pid for _, p in stack.tree()}), "healed": True}


def lost_end_round(stack: Stack, cluster: LocalCluster, reviver: Reviver, rnd: int, args: argparse.Namespace,
                   clean: dict[int, str]) -> dict[str, Any]:
    """`--fault lost-end`: ends that reached no replica, lost with their master."""
    counts = {"503": 0, "transport": 0}
    seed = cluster.nodes[0].port
    master = next(p for p in cluster.master_ports() if p != seed)
    held = partitions_of(cluster, master)
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        accepted = {j: i for i in range(args.jobs) if (j := submit(client, body(i, args.max_tokens), counts))}
        at_stake = set(accepted) - elsewhere(list(accepted), held)

        def statuses(jobs: set[str]) -> dict[str, str]:
            out = {}
            for job_id in jobs:
                with contextlib.suppress(httpx.TransportError):
                    r = client.get(f"/v1/jobs/{job_id}")
                    if r.status_code == 200:
                        out[job_id] = r.json()["status"]
            return out

        until("every job on the master to run", lambda: all(
            s != "queued" for s in statuses(at_stake).values()), 120, every=0.05)
        replica = cluster.replica_of(master)
        cluster.kill(replica, signal.SIGSTOP)
        with cluster.node(master).client() as node:
            node.client_kill_filter(_type="replica")
        alone = {j for j, s in statuses(at_stake).items() if s not in TERMINAL}  # their ends: on the master alone
        until("the master's jobs to end", lambda: all(s in TERMINAL for s in statuses(at_stake).values()), 120,
              every=0.1)
        cluster.kill(master)
        killed_at = time.monotonic()
        cluster.kill(replica, signal.SIGCONT)
        revived = reviver.revive(master)
        until("the replica promoted", lambda: replica in cluster.master_ports(), 60, every=0.1)
        ran_again: set[str] = set()
        ended: dict[str, dict[str, Any]] = {}
        while len(ended) < len(accepted) and time.monotonic() - killed_at < DRAIN_S:
            for job_id in [j for j in accepted if j not in ended]:
                with contextlib.suppress(httpx.TransportError):
                    r = client.get(f"/v1/jobs/{job_id}")
                    if r.status_code == 200 and r.json()["status"] in TERMINAL:
                        ended[job_id] = r.json()
                    elif r.status_code == 200:
                        ran_again.add(job_id)
            time.sleep(0.2)
        drained_s = time.monotonic() - killed_at
        wrong = count_wrong(client, ended, accepted, clean)
    revived.wait(90)
    healed = True
    try:
        cluster.wait_ok(timeout=60)
        cluster.wait_in_sync(timeout=60)
    except Exception:  # noqa: BLE001 - reported in the row
        healed = False
    lost = len(accepted) - len(ended)
    return {"round": rnd + 1, "accepted": len(accepted), "at_stake": len(at_stake), "ended_alone": len(alone),
            "ran_again": len(ran_again & at_stake), "lost": lost, "wrong": wrong, "stalled": lost > 0,
            "drained_s": round(drained_s, 1), "healed": healed}


def _refusals(node: Any) -> int:
    """How many writes the node has refused for too few replicas."""
    return int(node.info("errorstats").get("errorstat_NOREPLICAS", {}).get("count", 0))


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, model=False)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--jobs", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=0, help="each job's (48; 160 with --fault lost-end: its jobs "
                                                               "run while the replica is cut off)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model instead of the default one")
    ap.add_argument("--seeds", choices=["one", "all"], default="one", help="the nodes REDIS_URL names")
    ap.add_argument("--workdir", default="")
    ap.add_argument("--inference", type=int, default=1, help="inference workers (a job handed out again may go to "
                                                                 "another one)")
    ap.add_argument("--fault", choices=["kill", "pause-master", "pause-replica", "refuse-writes", "lost-end"],
                    default="kill", help="kill -9 of a master (default), a master paused until its replica took "
                                         "over, one replica paused for a while, a master refusing writes for a "
                                         "while, or ends that reached no replica lost with their master")
    args = ap.parse_args(argv)
    args.max_tokens = args.max_tokens or (160 if args.fault == "lost-end" else 48)
    if args.quick:
        args.rounds, args.jobs, args.max_tokens, args.tiny = 1, 4, 8, True
    work = Path(args.workdir or tempfile.mkdtemp(prefix="conveyor-failover-"))
    model = make_tiny_model(work / "tiny", default_model()) if args.tiny else default_model()
    cluster, broker = LocalCluster(work / "cluster"), RedisServer(work / "broker")
    rows = []
    reviver = Reviver(cluster)
    reviver.start()
    try:
        cluster.start()
        env = {**ENV, "CELERY_BROKER_URL": broker.start()}
        stack = start_stack(work / "stack", cluster.url if args.seeds == "one" else cluster.seed_url, model, env,
                            args=["--inference", str(args.inference)])
    except BaseException:
        cluster.stop()
        broker.stop()
        raise
    try:
        with httpx.Client(base_url=stack.url, timeout=120) as client:
            clean = {}
            for i in range(5):
                job_id = submit(client, body(i, args.max_tokens), {"503": 0, "transport": 0})
                while True:
                    job = client.get(f"/v1/jobs/{job_id}").json()
                    if job["status"] in TERMINAL:
                        break
                    time.sleep(0.2)
                clean[i] = job["text"]
        for rnd in range(args.rounds):
            if args.fault in ("pause-replica", "refuse-writes"):
                row = pause_round(stack, cluster, rnd, args)
            elif args.fault == "lost-end":
                row = lost_end_round(stack, cluster, reviver, rnd, args, clean)
            else:
                row = one_round(stack, cluster, reviver, rnd, args, clean)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        stop_stack(stack)
        cluster.stop()
        broker.stop()
    keys = ["round", "killed", "accepted", "lost", "wrong", "stalled", "drained_s", "503s", "healed"]
    if args.fault == "pause-master":
        keys += ["longest_gap_s", "gap_elsewhere_s", "slowest_poll_s"]
    if args.fault in ("kill", "pause-master"):
        keys += ["ttft_elsewhere_s", "submit_elsewhere_s", "start_elsewhere_s"]
    if args.fault in ("pause-replica", "refuse-writes"):
        keys = ["round", "accepted", "lost", "wrong", "ended_in_pause", "longest_gap_s", "gap_elsewhere_s",
                "gaps_over_1s", "restarted"]
        keys += ["refusals"] if args.fault == "refuse-writes" else []
    if args.fault == "lost-end":
        keys = ["round", "accepted", "at_stake", "ended_alone", "ran_again", "lost", "wrong", "stalled", "drained_s",
                "healed"]
    print(md_table(keys, [[r[k] for k in keys] for r in rows]))
    passed = sum(1 for r in rows if not r["lost"] and not r["wrong"] and r["healed"] and not r.get("restarted"))
    print(f"\n{passed} of {len(rows)} rounds passed: every accepted job ended with its clean text")
    return 0 if passed == len(rows) else 1
