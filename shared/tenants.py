"""Tenants and their API keys.

A key is shown once, when it is made; Redis keeps only its SHA-256 (`names.api_key_index`, which
names the tenant). The tenant hash (`names.tenant_key`) holds the key's digest, its limits, its
webhook signing secret, when it was made and whether it is disabled. Limits are per minute for
requests and tokens (token buckets, refilled continuously), and at once for unfinished jobs and
open event streams; 0 means no limit. The buckets are checked and charged in the submit script
(shared/scripts/submit.lua), in the same round trip that enqueues the job; a stream slot is taken
by shared/scripts/stream_open.lua.

The Batch API has limits of its own: `batch_tpm` is a separate token bucket for batch lines (the
driver's submits charge it instead of `rpm` and `tpm`, so a batch never spends the key's interactive
allowance; 0, the default, leaves batch lines unmetered: they run at the lowest priority, behind the
key's own interactive jobs, and the fair queue shields other tenants). Batch lines are not counted in the key's
`max_queued` nor in the service's queue cap (submit.lua): the driver's window and `max_open_batches` bound
them, and no interactive request waits behind them. `max_file_bytes` caps the bytes
of the key's stored files, `max_open_batches` its batches not yet ended, `max_batch_lines` the lines of
one batch (api/files.py, api/batches.py check them).
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

import redis

from shared import names
from shared.fence import Fence
from shared.job_ops import NotCopied
from shared.limits import WEIGHT_MAX, WEIGHT_MIN
from shared.redis_client import CLUSTER_TYPES, RETRYABLE, text

KEY_PREFIX = "cvk_"
LIMITS = ("rpm", "tpm", "max_queued", "max_streams", "batch_tpm", "max_file_bytes", "max_open_batches",
          "max_batch_lines")
DEFAULT_LIMITS = {"rpm": 600, "tpm": 1_000_000, "max_queued": 256, "max_streams": 256, "batch_tpm": 0,
                  "max_file_bytes": 2**30, "max_open_batches": 16, "max_batch_lines": 50_000}
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# an open stream's slot is leased this long, the lease renewed every STREAM_RENEW_S by the API process that holds it
# while the stream is open: a process that dies (kill -9, a crash) leaves its streams' slots for one lease at most
STREAM_LEASE_S = 60
STREAM_RENEW_S = 15.0


class TenantError(ValueError):
    """A tenant command that cannot be done (bad name, name taken, unknown name)."""


@dataclass(frozen=True)
class Tenant:
    name: str
    rpm: int
    tpm: int
    max_queued: int
    max_streams: int
    batch_tpm: int  # tokens per minute of its batch lines (a bucket apart from tpm)
    max_file_bytes: int  # bytes of its stored files, all told
    max_open_batches: int  # batches not yet ended
    max_batch_lines: int  # lines in one batch
    disabled: bool
    weight: float = 1.0  # its share of service against other backlogged tenants (shared/fair_queue.py)
    models: tuple[str, ...] = ()  # the models and adapters its key may name (empty: every one served)

    @classmethod
    def from_record(cls, name: str, rec: dict[str, str]) -> Tenant:
        return cls(name, **{k: int(rec.get(k) or 0) for k in LIMITS}, disabled=rec.get("disabled") == "1",
                   weight=float(rec.get("weight") or 1), models=split_models(rec.get("models") or ""))

    def may_use(self, model: str) -> bool:
        return not self.models or model in self.models


def split_models(value: str) -> tuple[str, ...]:
    """A `--models a,b` value (or a record's): the names, in order, each once."""
    return tuple(dict.fromkeys(m.strip() for m in value.split(",") if m.strip()))


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create(client: redis.Redis, name: str, weight: float = 1.0, models: tuple[str, ...] = (),
           **limits: int | None) -> tuple[str, str]:
    """Make a tenant with a new key. Returns (key, webhook secret): the key is stored as its digest only, the
    secret as it is (signing needs it), and neither is shown again. `weight`:
    its fair share against other backlogged tenants (WEIGHT_MIN..WEIGHT_MAX; a tenant of weight 2 is
    served twice the tokens of one of weight 1 while both wait). `models`: the models and LoRA adapters its
    key may name (empty: all; any other answers 404 for it). The functions here take a client that
    decodes responses (`decode_responses=True`)."""
    if not NAME_RE.fullmatch(name):
        raise TenantError("a name is 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit")
    if not WEIGHT_MIN <= weight <= WEIGHT_MAX:
        raise TenantError(f"a weight is between {WEIGHT_MIN} and {WEIGHT_MAX:g} (got {weight:g})")
    negative = [k for k, v in limits.items() if v is not None and v < 0]
    if negative:  # the scripts read a cap <= 0 as none: -5 would have meant no limit at all
        raise TenantError(f"a limit is 0 (no limit) or more; got {', '.join(f'{k}={limits[k]}' for k in negative)}")
    rec = client.hgetall(names.tenant_key(name))
    if rec and rec.get("disabled") != "1":
        raise TenantError(f"tenant {name!r} exists; revoke it first to issue a new key")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    secret = "whsec_" + secrets.token_urlsafe(32)
    digest = hash_key(key)
    old = text(rec.get("key_sha256"))
    values = {**DEFAULT_LIMITS, **{k: v for k, v in limits.items() if v is not None}}
    # two steps, each in one slot: the tenant's own keys (its partition), then the index that makes
    # the key valid, so a key never names a tenant that is not there yet
    pipe = client.pipeline(transaction=True)
    pipe.delete(names.tenant_key(name))
    pipe.delete(names.tenant_bucket_key(name, "requests"))
    pipe.delete(names.tenant_bucket_key(name, "tokens"))
    pipe.delete(names.tenant_bucket_key(name, "batch_tokens"))
    pipe.hset(names.tenant_key(name), mapping={"key_sha256": digest, "created_at": repr(time.time()),
                                               "disabled": "0", "webhook_secret": secret, "weight": repr(weight),
                                               "models": ",".join(models), **{k: int(values[k]) for k in LIMITS}})
    pipe.execute()
    pipe = client.pipeline(transaction=False)
    if old:
        pipe.delete(names.api_key_index(old))
    pipe.set(names.api_key_index(digest), name)
    pipe.sadd(names.TENANTS_SET, name)
    pipe.execute()
    _copied(client, [names.tenant_key(name), names.api_key_index(digest), names.TENANTS_SET], f"tenant {name!r}")
    return key, secret


def revoke(client: redis.Redis, name: str) -> None:
    """Disable a tenant's key at once (the API's short cache aside); its jobs keep running."""
    if not client.exists(names.tenant_key(name)):
        raise TenantError(f"no tenant {name!r}")
    client.hset(names.tenant_key(name), "disabled", "1")
    _copied(client, [names.tenant_key(name)], f"the revocation of tenant {name!r}")


def _copied(client: redis.Redis, keys: list[str], what: str) -> None:
    """On a cluster, that a replica has the writes to `keys` (shared/fence.py): a failover must not bring back a
    revoked key, nor lose a new one. A single Redis fsyncs before it answers."""
    if not isinstance(client, CLUSTER_TYPES):
        return
    try:
        Fence(client).confirm(keys)
    except (NotCopied, *RETRYABLE) as exc:
        raise TenantError(f"{what} was written, but no replica confirmed it ({exc}): check with `conveyor keys "
                          "list` once the cluster is healthy, and run the command again") from exc


def list_all(client: redis.Redis) -> list[dict[str, Any]]:
    """Every tenant with its limits and state (never the key or the secret)."""
    out = []
    for name in sorted(map(text, client.smembers(names.TENANTS_SET))):
        rec = client.hgetall(names.tenant_key(name))
        if rec:
            out.append({"name": name, "created_at": float(rec.get("created_at") or 0),
                        "disabled": rec.get("disabled") == "1", **{k: int(rec.get(k) or 0) for k in LIMITS},
                        "weight": float(rec.get("weight") or 1),
                        "models": list(split_models(text(rec.get("models") or ""))),
                        "active_jobs": int(client.get(names.tenant_active_key(name)) or 0)})
    return out
