"""After a job ends: usage accounting, and the client's webhook if the job asked for one; after a batch
ends, its webhook's event.

Every end (success, failure, cancel) is appended to the `ended` stream by the finish script, in the
same atomic step as the end itself, so none is missed. `drain` reads it through the `after-job`
consumer group (a Celery task that beat starts every 30 s and that waits on Redis for ends for
28 s, with the batch driver running beside it: see workers/celery_app.py), in batches:

- usage: a job's tokens went onto the totals of the day it ended (per model) with its end, in the finish script
  (shared/scripts/finish.lua), once; the drain's call per job (shared/scripts/account.lua, pipelined per batch)
  reads its webhook target, and counts a job that an earlier version ended without counting (the record's
  `accounted` marker makes each count happen once);
- the webhook gets the job (workers/webhook.py: what is sent, how it is signed, where it may not
  go), the batch's calls in parallel. A failure (no answer within WEBHOOK_TIMEOUT_S, a status other
  than 2xx, a redirect, an address refused) leaves the entry pending, to be tried again after
  WEBHOOK_RETRY_S, then twice as long after each failure (up to WEBHOOK_RETRY_MAX_S), up to WEBHOOK_ATTEMPTS
  tries (some 8 hours with the defaults); then it goes to the dead-letter stream, with the
  last failure's reason (also noted on the job record as `webhook_error`). Delivery is at least
  once: receivers deduplicate on `X-Conveyor-Job`;
- an entry with a `batch_id` instead of a `job_id` is a batch that ended with a webhook to call
  (workers/batch_driver.py adds it): its event goes out the same way, retried and dead-lettered alike (the
  failure noted on the batch's record), nothing accounted.

Entries of a Celery worker that died mid-drain are taken over once idle past CLAIM_IDLE_MS
(workers heartbeat under the `celery` pool name while they drain).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import redis

from shared import batch_ops, names, scripts
from shared.heartbeat import beat, forget
from shared.job_ops import USAGE_TTL_S, queue_account, queue_note_failure
from shared.masters import fail_fast
from shared.redis_client import CLUSTER_TYPES, RETRYABLE, text
from shared.retry import Backoff
from shared.scripts.codes import AccountReply
from shared.settings import Settings
from shared.stream_consumer import Entry, Ref, StreamConsumer
from workers.webhook import WebhookSender, redact

log = logging.getLogger("conveyor.after_job")

# an entry's webhook being delivered: (what: the job or batch id, where: the URL redacted, its delivery)
Hooks = dict[Ref, tuple[str, str, "Future[str | None]"]]

OUTSTANDING_PER_THREAD = 4  # deliveries unfinished per delivery thread, at most, before new ends are read
OUTAGE_BACKOFF_S = 2.0  # the longest wait between two tries while Redis is unreachable


def account(client: redis.Redis, job_ids: list[str]) -> list[AccountReply | Exception]:
    """Add each ended job's usage to the day's totals, once per job, in one pipeline. Per job: its
    webhook URL and owner (or that its record has expired), or the exception that stopped it."""
    pipe = client.pipeline(transaction=False)
    for job_id in job_ids:
        queue_account(pipe, job_id, USAGE_TTL_S)
    return [res if isinstance(res, Exception) else AccountReply.parse(res)
            for res in scripts.execute(pipe, raise_on_error=False)]


def _job_id(entry: Entry) -> str:
    return text(entry.fields.get(b"job_id") or entry.fields.get("job_id") or "")


def _batch_id(entry: Entry) -> str:
    return text(entry.fields.get(b"batch_id") or entry.fields.get("batch_id") or "")


def _record_key(entry: Entry) -> str:
    """The record an entry's webhook failures are noted on: its batch's, else its job's ('' none)."""
    if batch_id := _batch_id(entry):
        return names.batch_key(batch_id)
    job_id = _job_id(entry)
    return names.job_key(job_id) if job_id else ""


class _EndedConsumer(StreamConsumer):
    """Dead-letters a job (or batch) whose webhook kept failing with the last failure's reason."""

    def dead_letter(self, entry: Entry, reason: str) -> None:
        key = _record_key(entry)
        last = self.client.hget(key, "webhook_error") if key else None
        if last:
            reason = f"{reason}; last webhook failure: {text(last)}"
        super().dead_letter(entry, reason)


def _delivered(future: Future[str | None]) -> bool:
    """A finished delivery that succeeded (a failed one answers why, or raised)."""
    return future.exception() is None and future.result() is None


class AfterJob:
    """The after-job drain of one process: accounts ended jobs and sends their webhooks."""

    def __init__(self, client: redis.Redis, settings: Settings, consumer: str | None = None,
                 parallel: int = 16) -> None:
        self.client, self.settings = client, settings
        # (a cluster's) reads and upkeep master by master on a client that does not retry: a master that does not
        # answer costs the drain one short wait, not its retries, and holds back only its own partitions' ends
        fast = fail_fast(settings.redis_url) if isinstance(client, CLUSTER_TYPES) else None
        self.consumer = _EndedConsumer(client, names.streams(names.ENDED), names.AFTER_JOB_GROUP,
                                       consumer or f"after-{socket.gethostname()}-{os.getpid()}",
                                       names.CELERY_POOL, settings.claim_idle_ms, settings.webhook_attempts, fast=fast)
        self.consumer.ensure_group()
        self.webhooks = WebhookSender(client, settings, parallel)
        self._pool = ThreadPoolExecutor(parallel, thread_name_prefix="webhook")
        # deliveries unfinished at most (queued for a thread or running) before new ends are read: past it they wait
        # in Redis, not in this process (an endpoint that hangs, its tenant ending jobs faster than the pool gives up
        # on them, grew the pool's queue without end, every other tenant's webhooks behind it)
        self.outstanding_max = OUTSTANDING_PER_THREAD * parallel
        # deliveries not yet finished, by entry: an entry seen again (a retry) while its delivery goes on waits for
        # that one rather than queueing another (an endpoint that hangs would otherwise grow the pool's queue by its
        # whole backlog at each retry, ahead of every other tenant's deliveries)
        self._inflight: dict[Ref, Future[str | None]] = {}
        self.stopping = threading.Event()  # set: a waiting drain returns after its current wait
        self._beat_at = -math.inf  # when this drain's heartbeat was last written (monotonic)

    def drain(self, budget_s: float = 10.0, batch: int = 200, wait_ms: int = 0) -> dict[str, int]:
        """Handle what is due: retries, entries of dead workers, then new ends. With wait_ms 0,
        until none is left (or budget_s has passed); otherwise it also waits for new ends, wait_ms
        at a time, until budget_s has passed, so a job's webhook goes out as it ends and an idle
        drain costs one blocked read per wait. Redis unreachable meanwhile (restarted, a master failing
        over) is waited out, backing off, within the budget. Returns counts."""
        deadline = time.monotonic() + budget_s
        counts = {"done": 0, "failed": 0, "dead": 0}
        backoff = Backoff(0.1, OUTAGE_BACKOFF_S)
        while True:
            try:
                if self._round(deadline, batch, wait_ms, counts):
                    return counts
                if backoff.failures:
                    log.info("after-job drain: redis reachable again")
                    backoff.reset()
            except RETRYABLE as exc:  # what was in hand stays pending, and comes back as a retry
                if not backoff.failures:
                    log.warning("after-job drain: redis unavailable (%s); retrying with backoff", exc)
                left = deadline - time.monotonic()
                if left <= 0 or self.stopping.wait(min(backoff.next(), left)):
                    return counts

    def _round(self, deadline: float, batch: int, wait_ms: int, counts: dict[str, int]) -> bool:
        """Retries and dead workers' entries, then new ends while they come; True when the drain is over."""
        c = self.consumer
        self._beat()
        self._hold_queued()
        retry, dead = c.retry_own(int(self.settings.webhook_retry_s * 1000), count=batch, due_ms=self._backoff_ms)
        stale, dead_stale = c.claim_stale(count=batch)
        counts["dead"] += len(dead) + len(dead_stale)
        todo = retry + stale
        while True:
            if todo:
                self._handle(todo, counts)
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or self.stopping.is_set():
                return True
            unfinished = [f for f in self._inflight.values() if not f.done()]
            room = self.outstanding_max - len(unfinished)
            if room <= 0:  # the pool is behind: wait for a delivery to end, then a new round (retries, held entries)
                wait(unfinished, timeout=min(left_ms / 1000, self.settings.webhook_timeout_s),
                     return_when=FIRST_COMPLETED)
                return False
            self._beat(due=True)  # a drain that ends keep busy would otherwise beat once a run, and be taken for dead
            todo = c.read(count=min(batch, room), block_ms=min(wait_ms, left_ms) if wait_ms else None)
            if not todo:
                return not wait_ms  # nothing new: look at retries again, or stop

    def close(self) -> None:
        """Leave the group if nothing is pending here (consumers are per process)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.webhooks.close()
        c = self.consumer
        c.ring.close()  # its subscription, on a cluster
        for stream in c.streams:
            if not self.client.xpending_range(stream, c.group, min="-", max="+", count=1, consumername=c.consumer):
                self.client.xgroup_delconsumer(stream, c.group, c.consumer)
        forget(self.client, names.CELERY_POOL, c.consumer)

    def _deliver(self, ref: Ref, send: Callable[..., str | None], *args: str) -> Future[str | None]:
        """The entry's delivery: the one an earlier try started, while it goes on or if it succeeded after that try
        stopped waiting (sending it again would post it twice), else a new one."""
        future = self._inflight.get(ref)
        if future is None or (future.done() and not _delivered(future)):
            future = self._inflight[ref] = self._pool.submit(send, *args)
        return future

    def _backoff_ms(self, tries: int) -> int:
        """How long after its `tries`-th try a failed webhook is tried again: WEBHOOK_RETRY_S, doubling, up to
        WEBHOOK_RETRY_MAX_S (a receiver down for hours still gets its webhooks)."""
        s = self.settings
        return int(min(s.webhook_retry_max_s, s.webhook_retry_s * 2 ** min(max(tries - 1, 0), 30)) * 1000)

    def _hold_queued(self) -> None:
        """Keep the entries whose delivery still waits for a thread from going idle: a retry would count a try that
        never happened (one endpoint that hangs fills the pool; the others' deliveries wait behind it, and were
        dead-lettered for the wait)."""
        queued = [ref for ref, f in self._inflight.items() if not f.running() and not f.done()]
        if queued:
            self.consumer.refresh(queued)

    def _beat(self, due: bool = False) -> None:
        """This drain's heartbeat; with `due`, only once a quarter of its lifetime has passed since the last."""
        ttl_ms = max(self.settings.claim_idle_ms, 10_000)
        now = time.monotonic()
        if due and now - self._beat_at < ttl_ms / 4000:
            return
        beat(self.client, names.CELERY_POOL, self.consumer.consumer, "1", ttl_ms)
        self._beat_at = now

    def _handle(self, entries: list[Entry], counts: dict[str, int]) -> None:
        """Account every job of the batch (one pipeline), post the webhooks (jobs' and ended batches')
        in parallel, ack what is done. An entry whose webhook fails stays pending, its reason noted on
        its record; nothing in one entry stops the others."""
        hooks, unaccounted, lettered = self._account(entries)
        wait([f for *_, f in hooks.values()], timeout=self.settings.webhook_timeout_s * 3)
        done, failures = self._outcomes(entries, hooks, unaccounted | lettered)
        self.consumer.ack(done)
        self._note(entries, hooks, set(done), failures)
        counts["done"] += len(done)
        counts["dead"] += len(lettered)
        counts["failed"] += len(entries) - len(done) - len(lettered)

    def _account(self, entries: list[Entry]) -> tuple[Hooks, set[Ref], set[Ref]]:
        """The jobs' usage accounted, and every webhook due handed to the delivery threads: (the webhooks by entry,
        the entries whose accounting failed, those dead-lettered)."""
        jobs = [e for e in entries if not _batch_id(e)]
        ids = [_job_id(e) for e in jobs]
        hooks: Hooks = {}
        unaccounted, lettered = set(), set()
        for entry, job_id, found in zip(jobs, ids, account(self.client, ids)):
            if isinstance(found, Exception):
                log.warning("accounting %s failed: %s; will retry", job_id, found)
                unaccounted.add(entry.ref)
            elif found.expired and entry.deliveries > 1:  # tried before (its webhook failed, most likely), and its
                # record has expired since (JOB_TTL_S): the webhook cannot be sent. (Read first after the record
                # expired, an end is done: its usage was counted with it, and whether it had a webhook is not known.)
                self.consumer.dead_letter(entry, "its job's record expired before its end was handled (its webhook "
                                                 "was not sent)")
                lettered.add(entry.ref)
            elif found.webhook_url:
                hooks[entry.ref] = (job_id, redact(found.webhook_url), self._deliver(
                    entry.ref, self.webhooks.send, job_id, found.webhook_url, found.owner))
        for entry in entries:
            if batch_id := _batch_id(entry):
                hooks[entry.ref] = (batch_id, "its webhook",
                                    self._deliver(entry.ref, self.webhooks.send_batch, batch_id))
        return hooks, unaccounted, lettered

    @staticmethod
    def _outcomes(entries: list[Entry], hooks: Hooks, skipped: set[Ref],
                  ) -> tuple[list[Ref], dict[Ref, tuple[Entry, str]]]:
        """The entries done (no webhook, or it went through), and those whose webhook failed, with why; those
        `skipped` and those whose delivery has not started are neither."""
        done, failures = [], {}
        for entry in entries:
            if entry.ref in skipped:
                continue
            if entry.ref not in hooks:
                done.append(entry.ref)
                continue
            what, where, future = hooks[entry.ref]
            if not future.done() and not future.running():
                continue  # still waiting for a thread: no try yet (kept from going idle, _hold_queued)
            if not future.done():
                why = "did not finish in time"
            elif future.exception() is not None:
                why = f"failed: {future.exception()!r}"
            elif future.result() is None:
                done.append(entry.ref)
                continue
            else:
                why = str(future.result())
            failures[entry.ref] = (entry, why)
            log.warning("webhook for %s to %s: %s; will retry", what, where, why)
        return done, failures

    def _note(self, entries: list[Entry], hooks: Hooks, acked: set[Ref],
              failures: dict[Ref, tuple[Entry, str]]) -> None:
        """On the records: a retried webhook that went through clears its last failure, a failed one notes why.
        Deliveries still going on, and those that succeeded after their round stopped waiting, are kept."""
        mended = [key for e in entries if e.ref in acked and e.ref in hooks and e.deliveries > 1
                  and (key := _record_key(e))]
        if mended:  # a retry went through: the last failure noted on its record is over
            pipe = self.client.pipeline(transaction=False)
            for key in mended:
                pipe.hdel(key, "webhook_error")
            pipe.execute(raise_on_error=False)
        self._inflight = {ref: f for ref, f in self._inflight.items()
                          if ref not in acked and (not f.done() or _delivered(f))}
        if failures:
            pipe = self.client.pipeline(transaction=False)
            for entry, why in failures.values():
                if batch_id := _batch_id(entry):
                    batch_ops.queue_note_failure(pipe, batch_id, why)  # the same note, on its record
                else:
                    queue_note_failure(pipe, _job_id(entry), why)
            scripts.execute(pipe, raise_on_error=False)
