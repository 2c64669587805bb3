"""The Celery app: work that runs after a job ends (usage accounting, webhooks) and periodic
upkeep (stream trimming, which nothing else does), both on beat's schedule. `conveyor up` runs one
worker with beat embedded; on a cluster:

    celery -A workers.celery_app worker      # tasks
    celery -A workers.celery_app beat        # schedule
"""

from __future__ import annotations

from typing import Any

import redis
from celery import Celery
from celery.signals import worker_ready, worker_shutdown, worker_shutting_down

from shared import names
from shared.redis_client import is_cluster, sync_client
from shared.settings import get_settings
from workers import upkeep
from workers.after_job import AfterJob

settings = get_settings()
AFTER_JOBS_EVERY_S = 30.0
AFTER_JOBS_RUN_S = 25.0
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
    result_backend=None,
    beat_schedule={
        "trim-consumed-streams": {"task": "conveyor.trim_streams", "schedule": 30.0},
        # each run drains for AFTER_JOBS_RUN_S, blocked on Redis while nothing ends (webhooks go out as jobs
        # end, and an idle worker and beat cost next to nothing); a run not started in time is dropped
        "after-jobs": {"task": "conveyor.after_jobs", "schedule": AFTER_JOBS_EVERY_S,
                       "options": {"expires": AFTER_JOBS_EVERY_S}},
    },
)

_client: Any = None


def client() -> Any:
    global _client
    if _client is None:
        _client = sync_client(settings.redis_url, decode=False)
    return _client


@app.task(name="conveyor.trim_streams")
def trim_streams() -> dict[str, int]:
    """Drop stream entries that every consumer has finished with."""
    return upkeep.trim_all(client())


_after: AfterJob | None = None


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


@app.task(name="conveyor.after_jobs")
def after_jobs() -> dict[str, int]:
    """Usage accounting and webhooks for jobs that ended (see workers/after_job.py)."""
    global _after
    if _after is None:
        _after = AfterJob(client(), settings)
    return _after.drain(budget_s=AFTER_JOBS_RUN_S, wait_ms=2000)
