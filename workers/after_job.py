"""After a job ends: usage accounting, and the client's webhook if the job asked for one.

Every end (success, failure, cancel) is appended to the `ended` stream by the finish script, in the
same atomic step as the end itself, so none is missed. `drain` reads it through the `after-job`
consumer group (a Celery task that beat starts every 30 s and that waits on Redis for ends for
25 s, see workers/celery_app.py), in batches:

- usage is added to the day's totals (`names.usage_key()`, the date of the drain, per model) once
  per job: one script call per job (shared/scripts/account.lua), pipelined per batch; a marker
  field on the job's record makes a second delivery a no-op;
- the webhook gets `POST <webhook_url>` with the job object as polled (JSON), the batch's calls in
  parallel. A failure (no answer within WEBHOOK_TIMEOUT_S, a status other than 2xx, a redirect, an
  address refused, below) leaves the entry pending, to be tried again after WEBHOOK_RETRY_S, up to
  DELIVERY_LIMIT tries; then it goes to the dead-letter stream, with the last failure's reason
  (also noted on the job record as `webhook_error`). Delivery is at least once: receivers
  deduplicate on `X-Conveyor-Job`;
- a webhook cannot reach inside: its host is resolved at send time and refused if any address it
  resolves to is loopback, private, link-local, multicast, reserved, unspecified or a cloud
  metadata address (IPv4-mapped and other embedded IPv4 addresses included), unless
  WEBHOOK_ALLOW_PRIVATE (local development; metadata, multicast, reserved and unspecified
  addresses stay refused). The connection goes to an address that was checked, never to a second
  lookup of the name; the Host header, TLS SNI and the certificate check use the URL's host.
  WEBHOOK_TIMEOUT_S bounds the whole delivery: lookup, connect, send and answer;
- signed: `X-Conveyor-Signature: sha256=<HMAC-SHA256 of "<timestamp>." + body>` with
  `X-Conveyor-Timestamp: <unix seconds>` lets the receiver check the sender and refuse replays. A
  job submitted by a tenant (its record's `owner`) is signed with that tenant's `webhook_secret`;
  other jobs, and tenants without a secret of their own, with WEBHOOK_SECRET (unsigned if empty).
  Logs show a webhook URL as scheme://host[:port]/… only.

Entries of a Celery worker that died mid-drain are taken over once idle past CLAIM_IDLE_MS
(workers heartbeat under the `celery` pool name while they drain).
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import ipaddress
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any
from urllib.parse import urlsplit

import redis

from shared import names, scripts
from shared.heartbeat import beat, forget
from shared.jobs import Job
from shared.settings import Settings
from shared.stream_consumer import Entry, StreamConsumer

log = logging.getLogger("conveyor.after_job")

USAGE_TTL_S = 35 * 86400

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# instance metadata and host endpoints of the clouds; refused even with WEBHOOK_ALLOW_PRIVATE
METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254",  # AWS, GCP, Azure, OpenStack, DigitalOcean, Oracle, ...
    "169.254.170.2",  # AWS ECS task metadata
    "fd00:ec2::254",  # AWS over IPv6
    "100.100.100.200",  # Alibaba Cloud
    "168.63.129.16",  # Azure host endpoint (a public-looking address)
))
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def sign(body: bytes, secret: str, timestamp: str) -> str:
    return "sha256=" + hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


def redact(url: str) -> str:
    """A webhook URL fit for a log line: scheme://host[:port]/…, never its path, query or userinfo."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        return "<invalid URL>"
    if not host or parts.scheme not in ("http", "https"):
        return "<invalid URL>"
    host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{host}{f':{port}' if port else ''}/…"


def address_refusal(ip: IPAddress, allow_private: bool = False) -> str | None:
    """What makes `ip` no place for a webhook ("loopback", "private", ...), or None if it may go there."""
    if isinstance(ip, ipaddress.IPv6Address):
        inner = ip.ipv4_mapped or ip.sixtofour
        if inner is None and ip in _NAT64:
            inner = ipaddress.IPv4Address(int(ip) & 0xFFFF_FFFF)
        if inner is not None:  # an IPv4 address in IPv6 clothing is judged as itself
            return address_refusal(inner, allow_private)
    if ip in METADATA_ADDRESSES:
        return "a cloud metadata address"
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_multicast:
        return "multicast"
    if ip.is_loopback:  # before reserved: ::1 is both
        kind = "loopback"
    elif ip.is_link_local:
        kind = "link-local"
    elif ip.is_reserved:
        return "reserved"
    elif ip.is_private or (isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local):
        kind = "private"
    elif not ip.is_global:
        kind = "not a public address"  # e.g. 100.64.0.0/10, carrier-grade NAT
    else:
        return None
    return None if allow_private else kind


def resolve(host: str, port: int) -> list[IPAddress]:
    """Every address `host` resolves to, in the resolver's order, each once."""
    found: list[IPAddress] = []
    for *_, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        ip = ipaddress.ip_address(sockaddr[0])
        if ip not in found:
            found.append(ip)
    return found


class NotSent(Exception):
    """A webhook that is not sent: its URL or an address of its host is refused, or the host does not
    resolve. A failed try, like any other."""


class _PinnedConnection(http.client.HTTPConnection):
    """HTTP to addresses checked beforehand: connect() never looks the host up again, while the Host
    header (and, for HTTPS, SNI and the certificate check) still use the URL's host. Every socket
    operation gets the time left before `deadline`; abort() ends one that is blocked."""

    def __init__(self, host: str, port: int, addresses: list[IPAddress], deadline: float,
                 tls: ssl.SSLContext | None) -> None:
        super().__init__(host, port)
        self.addresses, self.deadline, self.tls = addresses, deadline, tls
        self.aborted = False

    def left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        return left

    def connect(self) -> None:
        error: OSError = OSError("no address")
        for ip in self.addresses:
            try:
                sock = socket.create_connection((str(ip), self.port), timeout=self.left())
            except OSError as exc:
                error = exc
                continue
            self.sock = sock  # from here on abort() can end a handshake that drags
            if self.tls is not None:
                sock.settimeout(self.left())
                self.sock = self.tls.wrap_socket(sock, server_hostname=self.host)
            return
        raise error

    def send(self, data: Any) -> None:
        if self.sock is not None:
            self.sock.settimeout(self.left())
        super().send(data)

    def getresponse(self) -> http.client.HTTPResponse:
        if self.sock is not None:
            self.sock.settimeout(self.left())
        return super().getresponse()

    def abort(self) -> None:
        self.aborted = True
        sock = self.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked read; close() alone would not
            except OSError:
                pass


class _EndedConsumer(StreamConsumer):
    """Dead-letters a job whose webhook kept failing with the last failure's reason."""

    def dead_letter(self, entry: Entry, reason: str) -> None:
        job_id = _s(entry.fields.get(b"job_id") or entry.fields.get("job_id") or "")  # type: ignore[call-overload]
        last = self.client.hget(names.job_key(job_id), "webhook_error") if job_id else None
        if last:
            reason = f"{reason}; last webhook failure: {_s(last)}"
        super().dead_letter(entry, reason)


class AfterJob:
    def __init__(self, client: redis.Redis, settings: Settings, consumer: str | None = None,
                 parallel: int = 16) -> None:
        self.client, self.settings = client, settings
        self.consumer = _EndedConsumer(client, names.ENDED_STREAM, names.AFTER_JOB_GROUP,
                                       consumer or f"after-{socket.gethostname()}-{os.getpid()}",
                                       names.CELERY_POOL, settings.claim_idle_ms, settings.delivery_limit)
        self.consumer.ensure_group()
        self._pool = ThreadPoolExecutor(parallel, thread_name_prefix="webhook")
        # lookups run apart, so one that hangs (getaddrinfo has no timeout) still ends the delivery on time
        self._lookups = ThreadPoolExecutor(parallel, thread_name_prefix="webhook-dns")
        self.resolve: Callable[[str, int], list[IPAddress]] = resolve
        self.tls = ssl.create_default_context()
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
        self._lookups.shutdown(wait=False, cancel_futures=True)
        c = self.consumer
        if not self.client.xpending_range(c.stream, c.group, min="-", max="+", count=1, consumername=c.consumer):
            self.client.xgroup_delconsumer(c.stream, c.group, c.consumer)
        forget(self.client, names.CELERY_POOL, c.consumer)

    def _beat(self) -> None:
        beat(self.client, names.CELERY_POOL, self.consumer.consumer, "1", max(self.settings.claim_idle_ms, 10_000))

    def _handle(self, entries: list[Entry], counts: dict[str, int]) -> None:
        """Account every job of the batch (one pipeline), post the webhooks in parallel, ack what
        is done. A job whose webhook fails stays pending, its reason noted on its record; nothing
        in one job stops the others."""
        pipe = self.client.pipeline(transaction=False)
        ids = [_s(e.fields.get(b"job_id") or e.fields.get("job_id") or "") for e in entries]  # type: ignore[call-overload]
        for job_id in ids:
            scripts.ACCOUNT.queue(pipe, [names.job_key(job_id), names.usage_key()], [USAGE_TTL_S])
        hooks, unaccounted = {}, set()
        for entry, job_id, found in zip(entries, ids, scripts.execute(pipe, raise_on_error=False)):
            if isinstance(found, Exception):
                log.warning("accounting %s failed: %s; will retry", job_id, found)
                unaccounted.add(entry.id)
            elif found and found[0]:
                url, owner = _s(found[0]), _s(found[1])
                hooks[entry.id] = (url, self._pool.submit(self._webhook, job_id, url, owner))
        wait([f for _, f in hooks.values()], timeout=self.settings.webhook_timeout_s * 3)
        done, failures = [], {}
        for entry, job_id in zip(entries, ids):
            if entry.id in unaccounted:
                continue
            if entry.id not in hooks:
                done.append(entry.id)
                continue
            url, future = hooks[entry.id]
            if not future.done():
                why = "did not finish in time"
            elif future.exception() is not None:
                why = f"failed: {future.exception()!r}"
            elif future.result() is None:
                done.append(entry.id)
                continue
            else:
                why = str(future.result())
            failures[job_id] = why
            log.warning("webhook for %s to %s: %s; will retry", job_id, redact(url), why)
        self.consumer.ack(done)
        if failures:
            pipe = self.client.pipeline(transaction=False)
            for job_id, why in failures.items():
                scripts.NOTE_FAILURE.queue(pipe, [names.job_key(job_id)], [why])
            scripts.execute(pipe, raise_on_error=False)
        counts["done"] += len(done)
        counts["failed"] += len(entries) - len(done)

    def _webhook(self, job_id: str, url: str, owner: str = "") -> str | None:
        """POST the job to its webhook. Returns None once delivered, else why not."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(names.job_key(job_id))
        pipe.get(names.text_key(job_id))
        if owner:
            pipe.hget(names.tenant_key(owner), "webhook_secret")
        raw, text, *tenant_secret = pipe.execute()
        if not raw:
            return None  # expired meanwhile: nothing left to send
        rec = {_s(k): _s(v) for k, v in raw.items()} | {"text": _s(text or b"")}
        secret = _s(tenant_secret[0]) if tenant_secret and tenant_secret[0] else self.settings.webhook_secret
        return self.post(url, Job.from_record(rec).model_dump_json().encode(), job_id, secret)

    def post(self, url: str, body: bytes, job_id: str, secret: str = "") -> str | None:
        """POST `body` to `url` within WEBHOOK_TIMEOUT_S, all told. Returns None on a 2xx answer,
        else why the delivery failed (a redirect is a failure: the target could be anywhere)."""
        timeout = self.settings.webhook_timeout_s
        deadline = time.monotonic() + timeout
        headers = {"Content-Type": "application/json", "User-Agent": "conveyor-webhook", "X-Conveyor-Job": job_id}
        if secret:
            ts = str(int(time.time()))
            headers["X-Conveyor-Timestamp"] = ts
            headers["X-Conveyor-Signature"] = sign(body, secret, ts)
        try:
            conn, path = self._connection(url, deadline)
        except NotSent as exc:
            return str(exc)
        watchdog = threading.Timer(max(deadline - time.monotonic(), 0.0), conn.abort)
        watchdog.daemon = True
        watchdog.start()
        try:
            conn.request("POST", path, body, headers)
            status = conn.getresponse().status
        except http.client.InvalidURL:
            return "invalid URL"
        except (OSError, http.client.HTTPException, ValueError) as exc:
            if conn.aborted or isinstance(exc, TimeoutError):
                return f"no answer within {timeout:g} s"
            return f"{type(exc).__name__}: {exc}"
        finally:
            watchdog.cancel()
            conn.close()
        if 300 <= status < 400:
            return f"answered {status} (a redirect; not followed)"
        return None if 200 <= status < 300 else f"answered {status}"

    def _connection(self, url: str, deadline: float) -> tuple[_PinnedConnection, str]:
        """A connection to the webhook's host pinned to its checked addresses, and the request path."""
        try:
            parts = urlsplit(url)
            host, port = parts.hostname, parts.port
        except ValueError:
            raise NotSent("invalid webhook URL; refused") from None
        if parts.scheme not in ("http", "https") or not host:
            raise NotSent("webhook URL is not http(s)://host/...; refused")
        if parts.username is not None or parts.password is not None:
            raise NotSent("webhook URL carries credentials; refused")
        try:
            host = host.encode("idna").decode("ascii")
        except UnicodeError:
            raise NotSent("webhook host is not a valid name; refused") from None
        port = port or (443 if parts.scheme == "https" else 80)
        lookup = self._lookups.submit(self.resolve, host, port)
        try:
            addresses = lookup.result(timeout=max(deadline - time.monotonic(), 0.0))
        except FutureTimeout:
            lookup.cancel()
            raise NotSent(f"webhook host {host} did not resolve within {self.settings.webhook_timeout_s:g} s") from None
        except (OSError, UnicodeError, ValueError) as exc:
            raise NotSent(f"webhook host {host} did not resolve ({exc})") from None
        if not addresses:
            raise NotSent(f"webhook host {host} has no address")
        for ip in addresses:
            why = address_refusal(ip, self.settings.webhook_allow_private)
            if why:
                raise NotSent(f"webhook address {_shown(ip)} is {why}; refused")
        tls = self.tls if parts.scheme == "https" else None
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return _PinnedConnection(host, port, addresses, deadline, tls), path


def _shown(ip: IPAddress) -> str:
    """An address as written: IPv4-mapped IPv6 in its dotted form (::ffff:127.0.0.1)."""
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return f"::ffff:{mapped}" if mapped else str(ip)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
