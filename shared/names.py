"""Every Redis key, stream, group and channel conveyor uses, under one prefix.

The keys that a script or a transaction touches together live in one hash slot, so that they run
on a Redis Cluster as on one node: a *partition* is a hash tag (`conveyor:{p0}:...`) that holds
the queue's streams and counters, the keys of the jobs in it and of the tenants whose jobs it
holds. A job id names its partition (its last two hex digits); a tenant's is fixed by its name.
There is one partition today (`PARTITIONS`); docs/redis-keys.md lists every key, its slot and who
writes it. Keys that are only ever touched alone (heartbeats, histograms, the tenant index) carry
no tag and spread over the cluster's masters.
"""

from __future__ import annotations

import time
import zlib

PREFIX = "conveyor"
PARTITIONS = 1


def partition_prefix(partition: int) -> str:
    """`conveyor:{p<n>}`: the hash tag of one partition, before the key's own name."""
    return f"{PREFIX}:{{p{partition}}}"


def job_partition(job_id: str) -> int:
    """The partition a job id names: its last two hex digits (ids that do not end so: partition 0)."""
    try:
        return int(job_id[-2:], 16) % PARTITIONS
    except ValueError:
        return 0


def tenant_partition(owner: str) -> int:
    """A tenant's home partition, where its limits and its jobs live."""
    return zlib.crc32(owner.encode()) % PARTITIONS


def new_job_suffix(owner: str) -> str:
    """The two hex digits that end a new job id of this owner: its tenant's partition."""
    return f"{tenant_partition(owner):02x}"


_P0 = partition_prefix(0)

# streams and their consumer groups (the autoscaler and KEDA read these names)
JOBS_STREAM = f"{_P0}:jobs"
TOKENIZED_STREAM = f"{_P0}:tokenized"
DEAD_LETTER_STREAM = f"{_P0}:dead"
TOKENIZER_GROUP = "tokenizers"
INFERENCE_GROUP = "inference"
# every job that ends is appended here (by shared/scripts/finish.lua, atomically with its end), for the
# after-job work in workers/after_job.py (usage accounting, the client's webhook)
ENDED_STREAM = f"{_P0}:ended"
AFTER_JOB_GROUP = "after-job"
ENDED_MAXLEN = 100_000  # approximate cap: bounded even when no Celery worker consumes it
STREAM_GROUPS = {JOBS_STREAM: TOKENIZER_GROUP, TOKENIZED_STREAM: INFERENCE_GROUP, ENDED_STREAM: AFTER_JOB_GROUP}

# pub/sub: a job's chunks on a channel in its partition (sharded pub/sub on a cluster); cancels
# are rare and broadcast
CONTROL_CHANNEL = f"{PREFIX}:control"

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
SUBMITTED_COUNTER = f"{_P0}:submitted"
DEQUEUED_COUNTER = f"{_P0}:dequeued"


def _job_prefix(job_id: str) -> str:
    return partition_prefix(job_partition(job_id))


def job_key(job_id: str) -> str:
    return f"{_job_prefix(job_id)}:job:{job_id}"


def events_key(job_id: str) -> str:
    return f"{_job_prefix(job_id)}:events:{job_id}"


def tokens_key(job_id: str) -> str:
    """Generated token ids so far (int32 little-endian), so another worker can resume the job."""
    return f"{_job_prefix(job_id)}:tokens:{job_id}"


def text_key(job_id: str) -> str:
    """The text streamed so far, appended per chunk (so each write is the chunk, not the whole text)."""
    return f"{_job_prefix(job_id)}:text:{job_id}"


def job_channel(job_id: str) -> str:
    return f"{_job_prefix(job_id)}:chan:{job_id}"


def channel_job_id(channel: bytes) -> str:
    """The job id of a job channel's name (the inverse of job_channel)."""
    return channel[channel.rindex(b":") + 1:].decode()


def idempotency_key(owner: str, key: str) -> str:
    """A client's idempotency key, scoped to its tenant, in the tenant's partition."""
    return f"{partition_prefix(tenant_partition(owner))}:idem:{owner}:{key}"


# heartbeats and the pools' registries share one slot (`{workers}`): snapshots read them together
def heartbeat_key(pool: str, worker_id: str) -> str:
    return f"{PREFIX}:{{workers}}:hb:{pool}:{worker_id}"


def workers_key(pool: str) -> str:
    """A pool's live workers: a sorted set of worker ids scored by when their heartbeat runs out
    (unix seconds), so readers find them without scanning the keyspace."""
    return f"{PREFIX}:{{workers}}:workers:{pool}"


# tenants (api keys): a hash per tenant, by name, and an index from the key's SHA-256 to the name.
# The key itself is never stored.
TENANTS_SET = f"{PREFIX}:tenants"


def _tenant_prefix(name: str) -> str:
    return partition_prefix(tenant_partition(name))


def tenant_key(name: str) -> str:
    """Tenant hash: key_sha256, created_at, disabled, rpm, tpm, max_queued, max_streams, webhook_secret."""
    return f"{_tenant_prefix(name)}:tenant:{name}"


def api_key_index(key_sha256: str) -> str:
    """The tenant name that owns the API key with this SHA-256 (hex)."""
    return f"{PREFIX}:apikey:{key_sha256}"


def tenant_bucket_key(owner: str, kind: str) -> str:
    """A tenant's token bucket (`requests` or `tokens`): a hash of tokens left and when it was read."""
    return f"{_tenant_prefix(owner)}:bucket:{owner}:{kind}"


def tenant_active_key(owner: str) -> str:
    """How many of a tenant's jobs have not ended yet."""
    return f"{_tenant_prefix(owner)}:active:{owner}"


def tenant_streams_key(owner: str) -> str:
    """A tenant's open event streams: a sorted set of stream ids scored by when their lease runs out."""
    return f"{PREFIX}:streams:{owner}"


def hist_key(metric: str) -> str:
    """A latency histogram's buckets, sum and count (shared/metrics.py)."""
    return f"{PREFIX}:hist:{metric}"


def usage_key(day: str | None = None, partition: int = 0) -> str:
    """Tokens and jobs per model for one UTC day (YYYY-MM-DD; today when None), kept 35 days; one
    per partition (the accounting script adds a job's usage in its partition)."""
    return f"{partition_prefix(partition)}:usage:{day or time.strftime('%Y-%m-%d', time.gmtime())}"
