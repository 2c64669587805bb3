"""After a job ends: usage accounting, and the client's webhook if the job asked for one.

Every end (success, failure, cancel) is appended to the `ended` stream by FINISH_SCRIPT, in the
same atomic step as the end itself, so none is missed. `drain` reads it through the `after-job`
consumer group (a Celery task that beat starts every 30 s and that waits on Redis for ends for
25 s, see workers/celery_app.py), in batches:

- usage is added to the day's totals (`conveyor:usage:<date of the drain>`, per model) once per
  job: one script call per job, pipelined per batch; a marker field on the job's record makes a
  second delivery a no-op;
- the webhook gets `POST <webhook_url>` with the job object as polled (JSON), the batch's calls in
  parallel. A failure (no answer within WEBHOOK_TIMEOUT_S, a status other than 2xx, a redirect)
  leaves the entry pending, to be tried again after WEBHOOK_RETRY_S, up to DELIVERY_LIMIT tries;
  then it goes to the dead-letter stream. Delivery is at least once: receivers deduplicate on
  `X-Conveyor-Job`;
- with WEBHOOK_SECRET set, `X-Conveyor-Signature: sha256=<HMAC-SHA256 of "<timestamp>." + body>`
  with `X-Conveyor-Timestamp: <unix seconds>` lets the receiver check the sender and refuse replays.

Entries of a Celery worker that died mid-drain are taken over once idle past CLAIM_IDLE_MS
(workers heartbeat under the `celery` pool name while they drain).
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import redis

from shared import names
from shared.jobs import Job
from shared.settings import Settings
from shared.stream_consumer import Entry, StreamConsumer

log = logging.getLogger("conveyor.after_job")

# KEYS[1] job hash, KEYS[2] the day's usage hash.  ARGV: ttl of the usage hash.
# Adds the job's tokens to the day's usage once (the job's `accounted` field marks it done).
# Returns the job's webhook URL ('' for none), or false when the record has expired.
ACCOUNT_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
if redis.call('HSETNX', KEYS[1], 'accounted', '1') == 1 then
  local rec = redis.call('HMGET', KEYS[1], 'model', 'prompt_tokens', 'completion_tokens')
  local model = rec[1] or ''
  redis.call('HINCRBY', KEYS[2], model .. ':prompt_tokens', tonumber(rec[2] or '0') or 0)
  redis.call('HINCRBY', KEYS[2], model .. ':completion_tokens', tonumber(rec[3] or '0') or 0)
  redis.call('HINCRBY', KEYS[2], model .. ':jobs', 1)
  redis.call('EXPIRE', KEYS[2], ARGV[1])
end
return redis.call('HGET', KEYS[1], 'webhook_url') or ''
"""
USAGE_TTL_S = 35 * 86400


def usage_key(day: str | None = None) -> str:
    return f"{names.PREFIX}:usage:{day or time.strftime('%Y-%m-%d', time.gmtime())}"


def sign(body: bytes, secret: str, timestamp: str) -> str:
    return "sha256=" + hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is a failure: urllib would turn the POST into a GET without the body, and the
    target could be anywhere."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_opener = urllib.request.build_opener(_NoRedirect)


class AfterJob:
    def __init__(self, client: redis.Redis, settings: Settings, consumer: str | None = None,
                 parallel: int = 16) -> None:
        self.client, self.settings = client, settings
        self.consumer = StreamConsumer(client, names.ENDED_STREAM, names.AFTER_JOB_GROUP,
                                       consumer or f"after-{socket.gethostname()}-{os.getpid()}",
                                       names.CELERY_POOL, settings.claim_idle_ms, settings.delivery_limit)
        self.consumer.ensure_group()
        self._account = client.register_script(ACCOUNT_SCRIPT)
        self._pool = ThreadPoolExecutor(parallel, thread_name_prefix="webhook")
        self.stopping = threading.Event()  # set: a waiting drain returns after its current wait

    def drain(self, budget_s: float = 10.0, batch: int = 200, wait_ms: int = 0) -> dict[str, int]:
        """Handle what is due: retries, entries of dead workers, then new ends. With wait_ms 0,
        until none is left (or budget_s has passed); otherwise it also waits for new ends, wait_ms
        at a time, until budget_s has passed, so a job's webhook goes out as it ends and an idle
        drain costs one blocked read per wait. Returns counts."""
        c = self.consumer
        deadline = time.monotonic() + budget_s
        counts = {"done": 0, "failed": 0, "dead": 0}
        while True:
            self._beat()
            retry, dead = c.retry_own(int(self.settings.webhook_retry_s * 1000), count=batch)
            stale, dead_stale = c.claim_stale(count=batch)
            counts["dead"] += len(dead) + len(dead_stale)
            todo = retry + stale
            while True:
                if todo:
                    self._handle(todo, counts)
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0 or self.stopping.is_set():
                    return counts
                todo = c.read(count=batch, block_ms=min(wait_ms, left_ms) if wait_ms else None)
                if not todo:
                    break  # nothing new: look at retries again, or stop
            if not wait_ms:
                return counts

    def close(self) -> None:
        """Leave the group if nothing is pending here (consumers are per process)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        c = self.consumer
        if not self.client.xpending_range(c.stream, c.group, min="-", max="+", count=1, consumername=c.consumer):
            self.client.xgroup_delconsumer(c.stream, c.group, c.consumer)
        self.client.delete(names.heartbeat_key(names.CELERY_POOL, c.consumer))

    def _beat(self) -> None:
        self.client.set(names.heartbeat_key(names.CELERY_POOL, self.consumer.consumer), "1",
                        px=max(self.settings.claim_idle_ms, 10_000))

    def _handle(self, entries: list[Entry], counts: dict[str, int]) -> None:
        """Account every job of the batch (one pipeline), post the webhooks in parallel, ack what
        is done. A job whose webhook fails stays pending; nothing in one job stops the others."""
        pipe = self.client.pipeline(transaction=False)
        ids = [_s(e.fields.get(b"job_id") or e.fields.get("job_id") or "") for e in entries]  # type: ignore[call-overload]
        for job_id in ids:
            self._account(keys=[names.job_key(job_id), usage_key()], args=[USAGE_TTL_S], client=pipe)
        hooks, unaccounted = {}, set()
        for entry, job_id, url in zip(entries, ids, pipe.execute(raise_on_error=False)):
            if isinstance(url, Exception):
                log.warning("accounting %s failed: %s; will retry", job_id, url)
                unaccounted.add(entry.id)
            elif url:
                hooks[entry.id] = self._pool.submit(self._webhook, job_id, _s(url))
        wait(hooks.values(), timeout=self.settings.webhook_timeout_s * 3)
        done = []
        for entry, job_id in zip(entries, ids):
            future = hooks.get(entry.id)
            if entry.id in unaccounted:
                continue
            if future is None:
                done.append(entry.id)
            elif not future.done():
                log.warning("webhook for %s did not finish in time; will retry", job_id)
            elif future.exception() is not None:
                log.warning("webhook for %s failed: %r; will retry", job_id, future.exception())
            elif future.result():
                done.append(entry.id)
        self.consumer.ack(done)
        counts["done"] += len(done)
        counts["failed"] += len(entries) - len(done)

    def _webhook(self, job_id: str, url: str) -> bool:
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(names.job_key(job_id))
        pipe.get(names.text_key(job_id))
        raw, text = pipe.execute()
        if not raw:
            return True  # expired meanwhile: nothing left to send
        rec = {_s(k): _s(v) for k, v in raw.items()} | {"text": _s(text or b"")}
        return self.post(url, Job.from_record(rec).model_dump_json().encode(), job_id)

    def post(self, url: str, body: bytes, job_id: str) -> bool:
        headers = {"Content-Type": "application/json", "User-Agent": "conveyor-webhook", "X-Conveyor-Job": job_id}
        if self.settings.webhook_secret:
            ts = str(int(time.time()))
            headers["X-Conveyor-Timestamp"] = ts
            headers["X-Conveyor-Signature"] = sign(body, self.settings.webhook_secret, ts)
        req = urllib.request.Request(url, data=body, headers=headers, method="POST")
        try:
            with _opener.open(req, timeout=self.settings.webhook_timeout_s) as resp:
                ok, status = 200 <= resp.status < 300, str(resp.status)
        except urllib.error.HTTPError as exc:
            ok, status = False, str(exc.code)
        except (OSError, ValueError, http.client.HTTPException) as exc:
            ok, status = False, repr(exc)
        if not ok:
            log.warning("webhook for %s to %s failed (%s); will retry", job_id, url, status)
        return ok


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
