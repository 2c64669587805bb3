"""The Celery app: the one mechanism for background work (the API only answers HTTP). Work that runs after a
job ends (usage accounting, webhooks: workers/after_job.py), batch driving (OpenAI's Batch API:
workers/batch_driver.py) and upkeep (stream trimming, which nothing else does), all on beat's schedule.
`conveyor up` runs one worker (`--pool solo`) with beat embedded; on a cluster:

    celery -A workers.celery_app worker      # tasks
    celery -A workers.celery_app beat        # schedule

How the drain and the driver share a worker: beat starts `after_jobs` every AFTER_JOBS_EVERY_S (and the worker
once when it is ready), and each run lasts AFTER_JOBS_RUN_S with two lanes side by side: the after-job drain in
the task's own thread, blocked on Redis while nothing ends, and the batch driver in a thread the run starts
and joins, ticking every TICK_S. Two lanes, not one loop that alternates between them, because the drain
waits on what it does not control: a webhook may take WEBHOOK_TIMEOUT_S to fail and is tried again later, and
an alternating loop would hold every batch's next submit behind it. One task, not a task each on a pool of
two, because a solo worker (and each prefork child) runs one task at a time, and runs of one task queued back
to back could take both places of a pool of two. The lanes share the run's life: both start with it, both
stop at its budget or at a warm shutdown (where the driver gives its leases up), and a worker that dies loses
both (its batches' leases lapse within LEASE_MS for the next driver to take). Any number of workers may run
it: the drain's consumer group and the driver's leases share the work out.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

import redis
from celery import Celery
from celery.signals import worker_ready, worker_shutdown, worker_shutting_down

from shared import names
from shared.masters import fail_fast
from shared.redis_client import RETRYABLE, heal, is_cluster, sync_client
from shared.settings import get_settings
from workers import upkeep
from workers.after_job import AfterJob
from workers.batch_driver import BatchDriver

log = logging.getLogger("conveyor.celery")
settings = get_settings()
AFTER_JOBS_EVERY_S = 30.0
AFTER_JOBS_RUN_S = 28.0  # the next run starts as this one ends: at most a couple of seconds without either lane
# how long the drain's read waits for new ends at a time; a warm shutdown waits for the wait under way, so a stack
# stops within it (at 2,000 ms, Celery was the last of a stack's processes to stop, ~2 s after the others)
DRAIN_WAIT_MS = 500
# Celery's broker is a single Redis (kombu has no cluster transport): CELERY_BROKER_URL, else REDIS_URL,
# which must then be a single node; the tasks themselves reach conveyor's keys through REDIS_URL
if not settings.celery_broker_url and settings.redis_url and is_cluster(settings.redis_url):
    raise SystemExit("REDIS_URL is a Redis Cluster, which cannot be Celery's broker: set CELERY_BROKER_URL "
                     "to a single-node Redis (`conveyor up --redis-cluster N` starts one)")
app = Celery("conveyor", broker=settings.celery_broker_url or settings.redis_url or "redis://127.0.0.1:6379/0")
app.conf.update(
    task_default_queue=names.CELERY_QUEUE,
    task_acks_late=True,  # a task whose worker dies is delivered again
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    # a broker that refuses a write (full, too few replicas, a failed save) answers an error reply, which kombu
    # counts a channel error: the consumer connects again and goes on, where the worker would exit
    broker_channel_error_retry=True,
    # and a run under way goes on meanwhile (it reaches conveyor's keys through its own client): its ack, lost with
    # the connection, only makes it run once more
    worker_cancel_long_running_tasks_on_connection_loss=False,
    result_backend=None,
    beat_schedule={
        "trim-consumed-streams": {"task": "conveyor.trim_streams", "schedule": 30.0},
        # each run drains and drives batches for AFTER_JOBS_RUN_S, blocked on Redis while nothing ends (webhooks
        # go out as jobs end, and an idle worker and beat cost next to nothing); a run not started in time is dropped
        "after-jobs": {"task": "conveyor.after_jobs", "schedule": AFTER_JOBS_EVERY_S,
                       "options": {"expires": AFTER_JOBS_EVERY_S}},
    },
)

_client: Any = None
_upkeep_client: Any = None


def client() -> Any:
    global _client
    if _client is None:
        _client = sync_client(settings.redis_url, decode=False)
    return _client


def upkeep_client() -> Any:
    """On a cluster, a client that does not retry and waits a moment at most (`fail_fast`): a master that does not
    answer costs the run that moment once, not a retrying client's seconds for each of its partitions."""
    global _upkeep_client
    if _upkeep_client is None:
        _upkeep_client = fail_fast(settings.redis_url) or client()
    return _upkeep_client


@app.task(name="conveyor.trim_streams")
def trim_streams() -> dict[str, int]:
    """Drop stream entries that every consumer has finished with, and consumers gone that hold none; a partition
    whose master does not answer waits for the next run (the others are trimmed), and in a single Redis's outage,
    nothing until the next run."""
    try:
        done = upkeep.run(upkeep_client(), settings.model_keys)
    except RETRYABLE as exc:
        log.warning("streams not trimmed this run: redis unavailable (%s)", exc)
        heal(upkeep_client())
        return {}
    if done.missed:
        log.warning("streams of partitions %s not trimmed this run: their master did not answer",
                    ",".join(map(str, sorted(done.missed))))
        heal(upkeep_client())
    return done.trimmed


_after: AfterJob | None = None
_driver: BatchDriver | None = None


@worker_ready.connect
def _start_draining(sender: Any, **_: Any) -> None:
    """The first run at once, not one schedule period after start."""
    sender.app.send_task("conveyor.after_jobs", expires=AFTER_JOBS_EVERY_S)


@worker_shutting_down.connect
def _stop_waiting(**_: Any) -> None:
    """A warm shutdown waits for the running task: end a waiting drain at its next wake-up."""
    if _after is not None:
        _after.stopping.set()


@worker_shutdown.connect
def _leave(**_: Any) -> None:
    if _after is not None:
        try:
            _after.close()
        except redis.RedisError:
            pass  # Redis gone at shutdown: the consumer stays listed, its entries are claimed later
    if _driver is not None:
        try:
            _driver.release()
        except redis.RedisError:
            pass  # its leases lapse by themselves within LEASE_MS


@app.task(name="conveyor.after_jobs")
def after_jobs() -> dict[str, int]:
    """Usage accounting and webhooks for jobs that ended (workers/after_job.py), and the batch driver beside
    them (workers/batch_driver.py), for AFTER_JOBS_RUN_S."""
    global _after, _driver
    if _after is None:
        _after = AfterJob(client(), settings)
    if _driver is None:
        _driver = BatchDriver(sync_client(settings.redis_url), settings)  # a client that decodes
    return run_lanes(_after, _driver, AFTER_JOBS_RUN_S)


def run_lanes(after: AfterJob, driver: BatchDriver, budget_s: float, wait_ms: int = DRAIN_WAIT_MS) -> dict[str, int]:
    """One run: the drain here for `budget_s` (waiting `wait_ms` at a time for ends), the driver ticking in a
    thread of its own until the drain returns (at its budget, at a warm shutdown, or raising), then giving up its
    batches' leases (the next run may land in another prefork child, a driver of its own: it takes them over at
    its first tick, not LEASE_MS later). The drain's counts, and the driver's ticks."""
    done = threading.Event()
    ticks: list[int] = []
    lane = threading.Thread(target=lambda: ticks.append(driver.run(done)), name="batch-driver", daemon=True)
    lane.start()
    try:
        counts = after.drain(budget_s=budget_s, wait_ms=wait_ms)
    finally:
        done.set()
        lane.join()
        with contextlib.suppress(redis.RedisError):  # (unreleased, they lapse by themselves)
            driver.release()
    return {**counts, "batch_ticks": sum(ticks)}
