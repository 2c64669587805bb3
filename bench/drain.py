"""A job that arrives as an idle inference worker drains: where it is once the worker has stopped, round after round.

    .venv/bin/python -m bench faults drain              # 20 rounds
    .venv/bin/python -m bench faults drain --quick      # 2 rounds

Each round starts one inference worker (the synthetic engine) on a redis-server of its own, waits until its reader
waits for a job, sends it SIGTERM and, 0 to 540 ms later (60 ms more each round, over ten), queues one long job as
the tokenizer does. The job must end up still queued (the reader no longer took jobs), or taken and then handed
back (claimable by the next worker at once, as if idle past CLAIM_IDLE_MS), or run; never held by the stopped
worker, where it would wait CLAIM_IDLE_MS (30 s by default) for another worker to claim it. A worker scaled in
while a job arrives, or the last one of a pool going back to zero, is this case. Exit status 1 if any was held.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from bench.common import ROOT, default_model, md_table, parser, tree_state

CLAIM_IDLE_MS = 60_000  # beyond a round: only a hand-back makes a taken job claimable within it
STEP_MS = 60


def _waiting_for_a_job(r: redis.Redis, deadline: float) -> None:
    while not any(c.get("cmd") == "blpop" for c in r.client_list()):
        if time.monotonic() > deadline:
            raise SystemExit("the worker's reader never waited for a job")
        time.sleep(0.01)


def one_round(r: redis.Redis, env: dict[str, str], i: int, log: Path) -> str:
    """Start a worker, stop it as a job arrives; where the job is once the worker is gone."""
    from shared import fair_queue, names
    from shared.jobs import new_record
    from shared.schemas import Request, encode_request

    r.flushdb()
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "infra.cli", "inference"], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        _waiting_for_a_job(r, time.monotonic() + 120)
        job_id = f"job-drain-{i}"
        r.hset(names.job_key(job_id), mapping=new_record(job_id, "m", "{}"))
        batch = encode_request(Request(job_id, [1, 2, 3], max_tokens=10**6, temperature=0.0, seed=1,
                                       ignore_eos=True))
        proc.send_signal(signal.SIGTERM)
        time.sleep((i % 10) * STEP_MS / 1000)
        fair_queue.push(r, 0, [], [(job_id, 0, 3, batch)])
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    status = (r.hget(names.job_key(job_id), "status") or b"?").decode()
    pending = r.xpending_range(names.stream(names.TOKENIZED, 0), names.INFERENCE_GROUP, "-", "+", 10)
    if code != 0:
        return f"worker exit {code}"
    if r.hexists(names.fair_key(0, "payload"), job_id):
        return "still queued"
    if not pending:
        return f"not pending ({status})"
    if all(p["time_since_delivered"] >= CLAIM_IDLE_MS for p in pending):
        return "taken, handed back"
    return "**held by the stopped worker**"


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, model=False)
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args(argv)
    from infra.redis_server import RedisServer

    rounds = 2 if args.quick else args.rounds
    tmp = Path(tempfile.mkdtemp(prefix="conveyor-drain-"))
    server = RedisServer(tmp / "redis")
    url = server.start()
    env = {**os.environ, "REDIS_URL": url, "MODEL": default_model(), "ENGINE": "synthetic",
           "CLAIM_IDLE_MS": str(CLAIM_IDLE_MS), "REFRESH_S": "0.5", "HEARTBEAT_S": "1", "DRAIN_GRACE_S": "2",
           "LOG_LEVEL": "INFO", "CONVEYOR_CACHE": str(tmp)}
    outcomes: collections.Counter[str] = collections.Counter()
    try:
        r = redis.Redis.from_url(url)
        for i in range(rounds):
            outcomes[one_round(r, env, i, tmp / "worker.log")] += 1
    finally:
        server.stop()
    print(f"# a job arriving as the worker drains, {rounds} rounds ({tree_state()})\n")
    print(md_table(["where the job was once the worker stopped", "rounds"], [[k, v] for k, v in outcomes.items()]))
    print(f"\nworkers' log: {tmp / 'worker.log'}")
    return 1 if outcomes["**held by the stopped worker**"] else 0
