"""After a job ends: usage accounting, and the client's webhook if the job asked for one.

Every end (success, failure, cancel) is appended to the `ended` stream by FINISH_SCRIPT, in the
same atomic step as the end itself, so none is missed. `drain` reads it through the `after-job`
consumer group (Celery beat runs it every second, see workers/celery_app.py):

- usage is added once per job (a marker field on the job's record makes a retry a no-op);
- the webhook gets `POST <webhook_url>` with the job object as polled (JSON); a failure (no
  answer in WEBHOOK_TIMEOUT_S, or a status other than 2xx) leaves the entry pending, to be tried
  again after WEBHOOK_RETRY_S, up to DELIVERY_LIMIT tries; then it goes to the dead-letter stream;
- with WEBHOOK_SECRET set, `X-Conveyor-Signature: sha256=<HMAC-SHA256 of the body>` lets the
  receiver check the sender.

Entries of a Celery worker that died mid-drain are taken over once idle past CLAIM_IDLE_MS
(workers heartbeat under the `celery` pool name while they drain).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import time
import urllib.error
import urllib.request
from typing import Any

import redis

from shared import names
from shared.jobs import Job
from shared.settings import Settings
from shared.stream_consumer import Entry, StreamConsumer

log = logging.getLogger("conveyor.after_job")

# KEYS[1] job hash, KEYS[2] the day's usage hash.  ARGV: ttl of the usage hash.
# Adds the job's tokens to the day's usage once: the job's `accounted` field marks it done.
ACCOUNT_SCRIPT = """
if redis.call('HSETNX', KEYS[1], 'accounted', '1') == 0 then return 0 end
local rec = redis.call('HMGET', KEYS[1], 'model', 'prompt_tokens', 'completion_tokens')
local model = rec[1] or ''
redis.call('HINCRBY', KEYS[2], model .. ':prompt_tokens', tonumber(rec[2] or '0') or 0)
redis.call('HINCRBY', KEYS[2], model .. ':completion_tokens', tonumber(rec[3] or '0') or 0)
redis.call('HINCRBY', KEYS[2], model .. ':jobs', 1)
redis.call('EXPIRE', KEYS[2], ARGV[1])
return 1
"""
USAGE_TTL_S = 35 * 86400


def usage_key(day: str | None = None) -> str:
    return f"{names.PREFIX}:usage:{day or time.strftime('%Y-%m-%d', time.gmtime())}"


def sign(body: bytes, secret: str) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


class AfterJob:
    def __init__(self, client: redis.Redis, settings: Settings, consumer: str | None = None) -> None:
        self.client, self.settings = client, settings
        self.consumer = StreamConsumer(client, names.ENDED_STREAM, names.AFTER_JOB_GROUP,
                                       consumer or f"after-{socket.gethostname()}-{os.getpid()}",
                                       names.CELERY_POOL, settings.claim_idle_ms, settings.delivery_limit)
        self.consumer.ensure_group()
        self._account = client.register_script(ACCOUNT_SCRIPT)

    def drain(self, max_entries: int = 1000) -> dict[str, int]:
        """Handle what is due: retries, entries of dead workers, then new ends. Returns counts."""
        c = self.consumer
        self.client.set(names.heartbeat_key(names.CELERY_POOL, c.consumer), "1",
                        px=max(self.settings.claim_idle_ms, 10_000))
        counts = {"done": 0, "failed": 0, "dead": 0}
        retry, dead = c.retry_own(int(self.settings.webhook_retry_s * 1000))
        stale, dead_stale = c.claim_stale()
        counts["dead"] = len(dead) + len(dead_stale)
        self._handle(retry + stale, counts)
        handled = len(retry) + len(stale)
        while handled < max_entries:
            new = c.read(count=min(100, max_entries - handled), block_ms=None)
            if not new:
                break
            self._handle(new, counts)
            handled += len(new)
        return counts

    def _handle(self, entries: list[Entry], counts: dict[str, int]) -> None:
        for entry in entries:
            job_id = entry.fields.get(b"job_id") or entry.fields.get("job_id")  # type: ignore[call-overload]
            job_id = job_id.decode() if isinstance(job_id, bytes) else str(job_id or "")
            if self.handle(job_id):
                self.consumer.ack([entry.id])
                counts["done"] += 1
            else:
                counts["failed"] += 1

    def handle(self, job_id: str) -> bool:
        """Account the job and call its webhook. False: try again later (the webhook failed)."""
        key = names.job_key(job_id)
        if not self.client.exists(key):
            return True  # expired: nothing left to report
        self._account(keys=[key, usage_key()], args=[USAGE_TTL_S])
        rec = {_s(k): _s(v) for k, v in self.client.hgetall(key).items()}
        url = rec.get("webhook_url")
        if not url:
            return True
        rec["text"] = _s(self.client.get(names.text_key(job_id)) or b"")
        body = Job.from_record(rec).model_dump_json().encode()
        return self.post(url, body, job_id)

    def post(self, url: str, body: bytes, job_id: str) -> bool:
        headers = {"Content-Type": "application/json", "User-Agent": "conveyor-webhook", "X-Conveyor-Job": job_id}
        if self.settings.webhook_secret:
            headers["X-Conveyor-Signature"] = sign(body, self.settings.webhook_secret)
        req = urllib.request.Request(url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.settings.webhook_timeout_s) as resp:
                ok = 200 <= resp.status < 300
                status = str(resp.status)
        except urllib.error.HTTPError as exc:
            ok, status = False, str(exc.code)
        except (OSError, ValueError) as exc:
            ok, status = False, repr(exc)
        if not ok:
            log.warning("webhook for %s to %s failed (%s); will retry", job_id, url, status)
        return ok


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
