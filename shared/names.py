"""Every Redis key, stream, group and channel conveyor uses, under one prefix.

The keys that a script or a transaction touches together live in one hash slot, so that they run
on a Redis Cluster as on one node: a *partition* is a hash tag (`conveyor:{p0}:...`) that holds
the queue's streams and counters, the keys of the jobs in it and of the tenants whose jobs it
holds. A job id names its partition (its last two hex digits); a tenant's is fixed by its name.
`REDIS_PARTITIONS` sets how many (1 by default: a single node gains nothing from more; on a
cluster, a few per master, so resharding moves whole partitions); docs/redis-keys.md lists every key, its slot and who
writes it. Keys that are only ever touched alone (heartbeats, histograms, the tenant index) carry
no tag and spread over the cluster's masters.
"""

from __future__ import annotations

import os
import random
import time
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

PREFIX = "conveyor"


def _partitions() -> int:
    n = int(os.environ.get("REDIS_PARTITIONS") or 1)
    if not 1 <= n <= 256:
        raise ValueError(f"REDIS_PARTITIONS={n}: between 1 and 256")
    return n


# how many partitions the queue has (REDIS_PARTITIONS, 1 by default; every process of a deployment
# must agree, and it may grow but not shrink while jobs live: a job id names its partition)
_count = _partitions()


def partition_count() -> int:
    """How many partitions the queue has: REDIS_PARTITIONS, unless `partitions_as` says otherwise."""
    return _count


@contextmanager
def partitions_as(n: int) -> Iterator[None]:
    """Name keys for a deployment of `n` partitions inside the block, in the whole process: for one that addresses
    a deployment other than its own, one at a time (the benchmarks that drive a single node and a cluster)."""
    global _count
    before, _count = _count, n
    try:
        yield
    finally:
        _count = before


def partition_prefix(partition: int) -> str:
    """`conveyor:{p<n>}`: the hash tag of one partition, before the key's own name."""
    return f"{PREFIX}:{{p{partition}}}"


def partitions() -> range:
    return range(partition_count())


def job_partition(job_id: str) -> int:
    """The partition a job id names: its last two hex digits (ids that do not end so: partition 0)."""
    try:
        return int(job_id[-2:], 16) % partition_count()
    except ValueError:
        return 0


def tenant_partition(owner: str) -> int:
    """A tenant's home partition, where its limits, its idempotency keys and its jobs live."""
    return zlib.crc32(owner.encode()) % partition_count()


def new_job_partition(owner: str, idempotency_key: str = "") -> int:
    """Where a new job goes: its tenant's partition; without a tenant, its idempotency key's, else any
    (spread at random)."""
    if owner:
        return tenant_partition(owner)
    if idempotency_key:
        return zlib.crc32(idempotency_key.encode()) % partition_count()
    return random.randrange(partition_count())


def job_id_in(partition: int, hex_id: str) -> str:
    """A job id (`job_<32 hex>`) whose last two hex digits name `partition`."""
    return f"job_{hex_id[:30]}{partition:02x}"


# streams, by kind, one of each per partition, and their consumer groups (the autoscaler and KEDA read them)
JOBS = "jobs"  # submitted jobs, for the tokenizer pool
TOKENIZED = "tokenized"  # Arrow record batches, for the inference pool
DEAD = "dead"  # entries delivered too often, with why
# every job that ends is appended here (by shared/scripts/finish.lua, atomically with its end), for the
# after-job work in workers/after_job.py (usage accounting, the client's webhook); so is every batch that
# ends with a webhook to call (entries with `batch_id` instead of `job_id`, by workers/batch_driver.py)
ENDED = "ended"
# tokenize calls (shared/tokenize_calls.py): `/tokenize`, `/detokenize` and the Messages API's token counts, answered
# by the tokenizer pool. A call goes on its partition's `tokenize` stream (read with `jobs`, by the same group); its
# reply is a key with a TTL and a message on the call's channel (`job_channel` of its id, so the API's relay
# subscribes to it as to a job's), both in the call's partition.
TOKENIZE = "tokenize"
TOKENIZER_GROUP = "tokenizers"
INFERENCE_GROUP = "inference"
AFTER_JOB_GROUP = "after-job"
GROUPS = {JOBS: TOKENIZER_GROUP, TOKENIZE: TOKENIZER_GROUP, TOKENIZED: INFERENCE_GROUP, ENDED: AFTER_JOB_GROUP}


def ended_min_id(now: float, ttl_s: int) -> str:
    """The oldest `ended` entry kept (XADD ... MINID ~): one as old as the records it names, which expire `ttl_s`
    after their end, so that even with no Celery worker consuming it the stream holds a TTL's worth of ends at most,
    and an end not yet handled (a webhook waiting out its retries, a drain that is down) is never trimmed while its
    record lives (a cap by count dropped those silently once the stream passed it)."""
    return f"{max(0, int((now - ttl_s) * 1000))}-0"


def model_prefix(partition: int, model: str = "") -> str:
    """Where a model's queue lives in a partition (its `tokenized` streams and fair-queue keys): the first
    model's (`model` '') is the partition's own, `conveyor:{p<n>}`; another's is `conveyor:{p<n>}:m:<name>`,
    in the same slot, so that a job's keys and its model's queue stay together."""
    return partition_prefix(partition) + (f":m:{model}" if model else "")


def stream(kind: str, partition: int, model: str = "") -> str:
    """A partition's stream of one kind; `model` names a model's own (`tokenized`: each model has its queue)."""
    return f"{model_prefix(partition, model)}:{kind}"


def streams(kind: str, model: str = "") -> list[str]:
    """The streams of one kind, partition by partition."""
    return [stream(kind, p, model) for p in partitions()]


def stream_model(name: bytes | str) -> str:
    """The model a partitioned key's queue belongs to ('' the first model's: the partition's own keys)."""
    tagged = name.decode() if isinstance(name, bytes) else name
    rest = tagged[tagged.index("}") + 2:]
    return rest.split(":", 2)[1] if rest.startswith("m:") else ""


def stream_partition(name: bytes | str) -> int:
    """The partition of a stream (or any partitioned key) from its hash tag."""
    tagged = name.decode() if isinstance(name, bytes) else name
    return int(tagged[tagged.index("{p") + 2:tagged.index("}")])


def stream_groups(models: Iterable[str] = ("",)) -> dict[str, str]:
    """{stream: group} of every stream a deployment serving `models` (their queue names: '' the first) reads:
    each partition's stream of every kind in GROUPS, and each other model's `tokenized` streams."""
    out = {stream(kind, p): group for kind, group in GROUPS.items() for p in partitions()}
    for model in models:
        if model:
            out.update(dict.fromkeys(streams(TOKENIZED, model), INFERENCE_GROUP))
    return out

# the fair queue in front of each partition's `tokenized` stream (shared/fair_queue.py), a fixed set of keys
# per partition: the backlogged tenants scored by virtual counter; the counters; the queued jobs' tokenized
# rows; an arrival counter; a doorbell; tokens served per tenant; every waiting job in one sorted set by
# (tenant, priority, arrival) and in one by (tenant, submit time); and each waiting job's place in both
FAIR_PARTS = ("tenants", "vtc", "payload", "arrivals", "bell", "served_by", "queue", "age", "waiting")
SERVED_TOTAL = "~"  # the member of `served_by` (a sorted set: tenant -> tokens served) that sums every tenant's
ANONYMOUS_TENANT = "_"  # the fair queue's tenant for jobs without one (no tenant name starts so)


def fair_key(partition: int, part: str, model: str = "") -> str:
    """One of a partition's fair-queue keys, by FAIR_PARTS name: the first model's queue, or `model`'s."""
    return f"{model_prefix(partition, model)}:fair:{part}"


# an idle consumer's wake-up on a cluster (shared/ring.py): in each partition, a flag set while a consumer group's
# consumer sleeps, naming the channel to ring (a classic one: any node relays it to every subscriber); the
# script that appends to one of the group's streams takes it (GETDEL) and rings


def ring_key(partition: int, group: str, model: str = "") -> str:
    """A partition's ring flag for a consumer group (of `model`'s queue, for the inference group)."""
    return f"{model_prefix(partition, model)}:ring:{group}"


def ring_channel(group: str, model: str = "") -> str:
    """The channel a group's sleeping consumers wait on."""
    return f"{PREFIX}:ring:{group}" + (f":{model}" if model else "")


# pub/sub: a job's chunks on a channel in its partition (sharded pub/sub on a cluster); cancels
# are rare and broadcast
CONTROL_CHANNEL = f"{PREFIX}:control"

# pools (heartbeat keys are grouped by pool)
TOKENIZER_POOL = "tokenizer"
INFERENCE_POOL = "inference"  # the first model's; another model's is `inference:<name>` (inference_pool)
POOLS = (TOKENIZER_POOL, INFERENCE_POOL)


def inference_pool(model: str = "") -> str:
    """The inference pool of a model, by its queue name ('' the first model: `inference`)."""
    return f"{INFERENCE_POOL}:{model}" if model else INFERENCE_POOL


def pools(models: Iterable[str] = ("",)) -> tuple[str, ...]:
    """The scaled pools of a deployment serving `models`: the tokenizer pool, then one inference pool each."""
    return (TOKENIZER_POOL, *(inference_pool(m) for m in models))
CELERY_POOL = "celery"  # heartbeats only (its consumers' liveness); not a scaled pool

# Celery's broker queue (a list); kombu adds `_kombu.binding.<queue>` and, with acks late, `unacked`,
# `unacked_index` and `unacked_mutex` of its own naming
CELERY_QUEUE = f"{PREFIX}:celery"

STATS_KEY = f"{PREFIX}:stats"
# LoRA adapters loaded at run time (POST /v1/load_lora_adapter): name -> its shared.lora.LoraModule as JSON
LORAS = f"{PREFIX}:loras"
# the local autoscaler's latest decisions that change or want to change a pool (capped; the dashboard reads it)
SCALING_DECISIONS_STREAM = f"{PREFIX}:scaling:decisions"


# queue position: ordinal of a job at submit, minus how many jobs have left the queue since (per partition)
def submitted_counter(partition: int, model: str = "") -> str:
    """The jobs submitted for a model's queue in a partition since the service began (the first model's: the
    partition's own counter); with `dequeued_counter`, the depth of that queue: each model's is its own, so one
    model's backlog neither fills another's queue cap nor moves its jobs' queue positions."""
    return f"{model_prefix(partition, model)}:submitted"


def dequeued_counter(partition: int, model: str = "") -> str:
    return f"{model_prefix(partition, model)}:dequeued"


def fence_key(key: str) -> str:
    """The fence in `key`'s slot (shared/fence.py), named after its hash tag (or, for a key without one, the whole
    key, which hashes the same): one short-lived key per tag, `conveyor:{p<n>}:fence` for a partition's keys."""
    start = key.find("{")
    end = key.find("}", start + 1) if start >= 0 else -1
    tag = key[start + 1:end] if end > start + 1 else key
    return f"{PREFIX}:{{{tag}}}:fence"


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


def logprobs_key(job_id: str) -> str:
    """The generated tokens' logprobs so far, one JSON array per token, newline-terminated (jobs that ask)."""
    return f"{_job_prefix(job_id)}:logprobs:{job_id}"


def prompt_logprobs_key(job_id: str) -> str:
    """The prompt tokens' logprobs (echo), one JSON document, written once."""
    return f"{_job_prefix(job_id)}:plogprobs:{job_id}"


def grammar_key(spec_key: str, model: str = "", partition: int = 0) -> str:
    """A compiled grammar (xgrammar's serialized form), by the hash of its spec: the tokenizer pool writes it,
    inference workers read it. One key per distinct grammar, model (a grammar is compiled for a vocabulary;
    `model` '' the first) and partition of the jobs that use it, with a TTL: a job's grammar is in its
    partition's slot, so a master that does not answer holds back its own partitions' jobs only."""
    return f"{model_prefix(partition, model)}:grammar:{spec_key}"


def file_key(file_id: str, part: str) -> str:
    """A file's `meta` (hash) and `data` (its bytes: a string, or for a batch's output a hash of lines)."""
    return f"{PREFIX}:file:{{{file_id}}}:{part}"


def files_index(owner: str) -> str:
    """A tenant's files, by creation time ('' is the tenant of requests without a key)."""
    return f"{PREFIX}:files:{owner or '_'}"


def file_bytes_key(owner: str) -> str:
    """A tenant's stored files' sizes: a hash of file id -> "<bytes>:<expires at, unix s>", so the total is
    right after a delete (the entry goes) and after an expiry (shared/scripts/file_bytes.lua drops it)."""
    return f"{PREFIX}:file-bytes:{owner or '_'}"


def batch_key(batch_id: str, part: str = "") -> str:
    """A batch's record, and its `lines` (index -> request), `inflight` (index -> job id), `out` and `err`
    (index -> result line) hashes and its driver's `lease`: one slot, so its scripts touch one node."""
    return f"{PREFIX}:batch:{{{batch_id}}}" + (f":{part}" if part else "")


def batches_index(owner: str) -> str:
    return f"{PREFIX}:batches:{owner or '_'}"


BATCHES_ACTIVE = f"{PREFIX}:batches:_active"  # batches a driver still has to advance (no tenant is named "_...")


def batches_open(owner: str) -> str:
    """A tenant's batches not yet ended, scored by when they expire (its max_open_batches counts them)."""
    return f"{PREFIX}:batches-open:{owner or '_'}"


def batch_partition(owner: str) -> int:
    """Where a batch's end goes on the `ended` stream (its webhook): its tenant's partition."""
    return tenant_partition(owner)


def job_channel(job_id: str) -> str:
    return f"{_job_prefix(job_id)}:chan:{job_id}"


def channel_job_id(channel: bytes) -> str:
    """The job id of a job channel's name (the inverse of job_channel)."""
    return channel[channel.rindex(b":") + 1:].decode()


def idempotency_key(owner: str, key: str) -> str:
    """A client's idempotency key, scoped to its tenant, in the partition of the job it names."""
    return f"{partition_prefix(new_job_partition(owner, key))}:idem:{owner}:{key}"


# heartbeats and the pools' registries share one slot (`{workers}`): snapshots read them together
def heartbeat_key(pool: str, worker_id: str) -> str:
    return f"{PREFIX}:{{workers}}:hb:{pool}:{worker_id}"


def fault_key(pool: str) -> str:
    """Why a pool's latest worker failed to start (shared/pool_fault.py), beside its registry."""
    return f"{PREFIX}:{{workers}}:fault:{pool}"


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
    """Tenant hash: key_sha256, created_at, disabled, weight, webhook_secret and its limits (tenants.LIMITS)."""
    return f"{_tenant_prefix(name)}:tenant:{name}"


def api_key_index(key_sha256: str) -> str:
    """The tenant name that owns the API key with this SHA-256 (hex)."""
    return f"{PREFIX}:apikey:{key_sha256}"


def tenant_bucket_key(owner: str, kind: str) -> str:
    """A tenant's token bucket (`requests`, `tokens`, or `batch_tokens` for its batch lines): a hash of
    tokens left and when it was read."""
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



def stream_kind(name: bytes | str) -> str:
    """A partitioned stream's kind (`jobs`, `tokenize`, ...): the last part of its name."""
    tagged = name.decode() if isinstance(name, bytes) else name
    return tagged.rsplit(":", 1)[1]


def tokenize_call_id(partition: int, hex_id: str) -> str:
    """A tokenize call's id (`tok_<32 hex>`), whose last two hex digits name `partition`, as a job id's do."""
    return f"tok_{hex_id[:30]}{partition:02x}"


def tokenize_reply_key(call_id: str) -> str:
    """A tokenize call's reply (JSON), with a short TTL: read when its channel's message was missed."""
    return f"{_job_prefix(call_id)}:tokreply:{call_id}"
