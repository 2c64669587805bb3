"""The Celery app: work that runs after a job ends, and periodic upkeep (beat).

    celery -A workers.celery_app worker      # tasks
    celery -A workers.celery_app beat        # schedule
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from shared.redis_client import sync_client
from shared.settings import get_settings
from workers import upkeep

settings = get_settings()
app = Celery("conveyor", broker=settings.redis_url or "redis://127.0.0.1:6379/0")
app.conf.update(
    task_default_queue="conveyor:celery",
    task_acks_late=True,  # a task whose worker dies is delivered again
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    result_backend=None,
    beat_schedule={
        "trim-consumed-streams": {"task": "conveyor.trim_streams", "schedule": 30.0},
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


@app.task(name="conveyor.record_usage", autoretry_for=(ConnectionError,), retry_backoff=True, max_retries=5)
def record_usage(model: str, prompt_tokens: int, completion_tokens: int) -> None:
    """Token accounting for a finished job."""
    upkeep.record_usage(client(), model, prompt_tokens, completion_tokens)
