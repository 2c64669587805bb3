"""Every Redis key, stream, group and channel conveyor uses, under one prefix."""

from __future__ import annotations

import time

PREFIX = "conveyor"

# streams and their consumer groups (the autoscaler and KEDA read these names)
JOBS_STREAM = f"{PREFIX}:jobs"
TOKENIZED_STREAM = f"{PREFIX}:tokenized"
DEAD_LETTER_STREAM = f"{PREFIX}:dead"
TOKENIZER_GROUP = "tokenizers"
INFERENCE_GROUP = "inference"
# every job that ends is appended here (by shared/scripts/finish.lua, atomically with its end), for the
# after-job work in workers/after_job.py (usage accounting, the client's webhook)
ENDED_STREAM = f"{PREFIX}:ended"
AFTER_JOB_GROUP = "after-job"
ENDED_MAXLEN = 100_000  # approximate cap: bounded even when no Celery worker consumes it
STREAM_GROUPS = {JOBS_STREAM: TOKENIZER_GROUP, TOKENIZED_STREAM: INFERENCE_GROUP, ENDED_STREAM: AFTER_JOB_GROUP}

# pub/sub
CONTROL_CHANNEL = f"{PREFIX}:control"
CHANNEL_PREFIX = f"{PREFIX}:chan:"

# pools (heartbeat keys are grouped by pool)
TOKENIZER_POOL = "tokenizer"
INFERENCE_POOL = "inference"
POOLS = (TOKENIZER_POOL, INFERENCE_POOL)
CELERY_POOL = "celery"  # heartbeats only (its consumers' liveness); not a scaled pool

# Celery's broker queue (a list); kombu adds `_kombu.binding.<queue>` and, with acks late, `unacked`,
# `unacked_index` and `unacked_mutex` of its own naming
CELERY_QUEUE = f"{PREFIX}:celery"

STATS_KEY = f"{PREFIX}:stats"
# the local autoscaler's latest decisions that change or want to change a pool (capped; the dashboard reads it)
SCALING_DECISIONS_STREAM = f"{PREFIX}:scaling:decisions"
# queue position: ordinal of a job at submit, minus how many jobs have left the queue since
SUBMITTED_COUNTER = f"{PREFIX}:submitted"
DEQUEUED_COUNTER = f"{PREFIX}:dequeued"


def job_key(job_id: str) -> str:
    return f"{PREFIX}:job:{job_id}"


def events_key(job_id: str) -> str:
    return f"{PREFIX}:events:{job_id}"


def tokens_key(job_id: str) -> str:
    """Generated token ids so far (int32 little-endian), so another worker can resume the job."""
    return f"{PREFIX}:tokens:{job_id}"


def text_key(job_id: str) -> str:
    """The text streamed so far, appended per chunk (so each write is the chunk, not the whole text)."""
    return f"{PREFIX}:text:{job_id}"


def job_channel(job_id: str) -> str:
    return f"{CHANNEL_PREFIX}{job_id}"


def idempotency_key(key: str) -> str:
    return f"{PREFIX}:idem:{key}"


def heartbeat_key(pool: str, worker_id: str) -> str:
    return f"{PREFIX}:hb:{pool}:{worker_id}"


def workers_key(pool: str) -> str:
    """A pool's live workers: a sorted set of worker ids scored by when their heartbeat runs out
    (unix seconds), so readers find them without scanning the keyspace."""
    return f"{PREFIX}:workers:{pool}"


# tenants (api keys): a hash per tenant, by name, and an index from the key's SHA-256 to the name.
# The key itself is never stored.
TENANTS_SET = f"{PREFIX}:tenants"


def tenant_key(name: str) -> str:
    """Tenant hash: key_sha256, created_at, disabled, rpm, tpm, max_queued, max_streams, webhook_secret."""
    return f"{PREFIX}:tenant:{name}"


def api_key_index(key_sha256: str) -> str:
    """The tenant name that owns the API key with this SHA-256 (hex)."""
    return f"{PREFIX}:apikey:{key_sha256}"


def tenant_bucket_key(owner: str, kind: str) -> str:
    """A tenant's token bucket (`requests` or `tokens`): a hash of tokens left and when it was read."""
    return f"{PREFIX}:bucket:{owner}:{kind}"


def tenant_active_key(owner: str) -> str:
    """How many of a tenant's jobs have not ended yet."""
    return f"{PREFIX}:active:{owner}"


def tenant_streams_key(owner: str) -> str:
    """A tenant's open event streams: a sorted set of stream ids scored by when their lease runs out."""
    return f"{PREFIX}:streams:{owner}"


def hist_key(metric: str) -> str:
    """A latency histogram's buckets, sum and count (shared/metrics.py)."""
    return f"{PREFIX}:hist:{metric}"


def usage_key(day: str | None = None) -> str:
    """Tokens and jobs per model for one UTC day (YYYY-MM-DD; today when None), kept 35 days."""
    return f"{PREFIX}:usage:{day or time.strftime('%Y-%m-%d', time.gmtime())}"
