"""Webhook delivery: `POST <webhook_url>` with the job object as polled (JSON), or, for a batch that
ended, OpenAI's event (`{"object": "event", "id": "evt_…", "type": "batch.completed", "created_at": …,
"data": {"id": <batch id>}}`, type batch.completed, batch.failed, batch.expired or batch.cancelled),
signed, never inside.

- a webhook cannot reach inside: its host is resolved at send time and refused if any address it
  resolves to is loopback, private, link-local, multicast, reserved, unspecified or a cloud
  metadata address (IPv4-mapped and other embedded IPv4 addresses included), unless
  WEBHOOK_ALLOW_PRIVATE (local development; metadata, multicast, reserved and unspecified
  addresses stay refused). The connection goes to an address that was checked, never to a second
  lookup of the name; the Host header, TLS SNI and the certificate check use the URL's host.
  WEBHOOK_TIMEOUT_S bounds the whole delivery: lookup, connect, send and answer;
- a delivery succeeds on a 2xx answer only; a redirect is a failure (the target could be anywhere);
- signed: `X-Conveyor-Signature: sha256=<HMAC-SHA256 of "<timestamp>." + body>` with
  `X-Conveyor-Timestamp: <unix seconds>` lets the receiver check the sender and refuse replays. A
  job submitted by a tenant (its record's `owner`) is signed with that tenant's `webhook_secret`;
  other jobs, and tenants without a secret of their own, with WEBHOOK_SECRET (unsigned if empty); a
  batch's event likewise by its owner. Receivers deduplicate on `X-Conveyor-Job` (a batch's event:
  `X-Conveyor-Batch`, and its id, the same for every delivery).

Logs show a webhook URL as scheme://host[:port]/… only (`redact`).
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import ipaddress
import json
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any
from urllib.parse import urlsplit

import redis

from shared import names
from shared.jobs import BATCH_ENDS, Job
from shared.limits import url_port, webhook_port_refusal
from shared.redis_client import text
from shared.settings import Settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
LOOKUPS_PER_THREAD = 4  # lookups of distinct hosts under way or waiting, per lookup thread, at most
SILENT_S = 30.0  # a host that let a delivery time out is tried by one probe at a time this long after
PROBE_EVERY_S = 5.0  # and by one probe this often at most
SILENT_HOSTS_MAX = 1024  # such hosts remembered at most
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
    """The `X-Conveyor-Signature` value of `body` sent at `timestamp`."""
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


class WebhookSender:
    """Sends ended jobs to their webhooks, one delivery per call, safe to call from many threads.
    `resolve` and `tls` are the name lookup and the TLS context its connections use."""

    def __init__(self, client: redis.Redis, settings: Settings, parallel: int = 16) -> None:
        self.client, self.settings = client, settings
        # lookups run apart, so one that hangs (getaddrinfo has no timeout) still ends the delivery on time; one at
        # a time per host and port, shared by its deliveries: a name whose servers never answer holds one thread,
        # not every one (each other tenant's lookup waited behind them, and failed)
        self._lookups = ThreadPoolExecutor(parallel, thread_name_prefix="webhook-dns")
        self._resolving: dict[tuple[str, int], Future[list[IPAddress]]] = {}
        self._resolving_lock = threading.RLock()  # (a lookup done at once calls back under it)
        # lookups of distinct hosts under way or waiting, at most: names whose servers never answer (a domain's
        # random subdomains) otherwise queued lookups without end, every other tenant's behind them
        self.lookups_max = LOOKUPS_PER_THREAD * parallel
        self.resolve: Callable[[str, int], list[IPAddress]] = resolve
        self.tls = ssl.create_default_context()
        # hosts that let a delivery time out: (until when, the next probe's time), monotonic: meanwhile one delivery
        # at a time tries them, PROBE_EVERY_S apart at most (`_probing`), the others fail at once, each retried after
        # its backoff as any failure; one endpoint that hangs held a delivery thread WEBHOOK_TIMEOUT_S per delivery,
        # every tenant's webhooks behind them
        self._silent: dict[tuple[str, int], tuple[float, float]] = {}
        self._probing: set[tuple[str, int]] = set()
        self._silent_lock = threading.Lock()

    def send(self, job_id: str, url: str, owner: str = "") -> str | None:
        """POST the job, as polled, to its webhook. Returns None once delivered (or when the job has
        expired meanwhile), else why not."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(names.job_key(job_id))
        pipe.get(names.text_key(job_id))
        pipe.get(names.logprobs_key(job_id))  # (the record's side keys, as a poll reads them: JobOps.read)
        pipe.get(names.prompt_logprobs_key(job_id))
        if owner:
            pipe.hget(names.tenant_key(owner), "webhook_secret")
        raw, job_text, logprobs, prompt_logprobs, *tenant_secret = pipe.execute()
        if not raw:
            return None  # expired meanwhile: nothing left to send
        rec = {text(k): text(v) for k, v in raw.items()} | {
            "text": text(job_text), "logprobs": text(logprobs), "prompt_logprobs": text(prompt_logprobs)}
        secret = text(tenant_secret[0]) if tenant_secret and tenant_secret[0] else self.settings.webhook_secret
        return self.post(url, Job.from_record(rec).model_dump_json().encode(), job_id, secret)

    def send_batch(self, batch_id: str) -> str | None:
        """POST an ended batch's event to the webhook it was made with. Returns None once delivered (or
        when there is nothing to send: the batch has expired meanwhile, or has no webhook), else why not."""
        rec = {text(k): text(v) for k, v in self.client.hgetall(names.batch_key(batch_id)).items()}
        status, url = rec.get("status", ""), rec.get("webhook_url", "")
        if status not in BATCH_ENDS or not url:
            return None
        owner = rec.get("owner", "")
        tenant_secret = text(self.client.hget(names.tenant_key(owner), "webhook_secret")) if owner else ""
        event = {"object": "event", "id": "evt_" + batch_id.removeprefix("batch_"), "type": f"batch.{status}",
                 "created_at": int(float(rec.get(f"{status}_at") or time.time())), "data": {"id": batch_id}}
        body = json.dumps(event, separators=(",", ":")).encode()
        return self.post(url, body, batch_id, tenant_secret or self.settings.webhook_secret, "X-Conveyor-Batch")

    def post(self, url: str, body: bytes, job_id: str, secret: str = "", id_header: str = "X-Conveyor-Job"
             ) -> str | None:
        """POST `body` to `url` within WEBHOOK_TIMEOUT_S, all told, with `job_id` in `id_header`. Returns
        None on a 2xx answer, else why the delivery failed (a redirect is a failure: the target could be
        anywhere). A host that let a delivery time out within SILENT_S is tried by one delivery at a time; the others
        fail at once, without a connection."""
        timeout = self.settings.webhook_timeout_s
        deadline = time.monotonic() + timeout
        headers = {"Content-Type": "application/json", "User-Agent": "conveyor-webhook", id_header: job_id}
        if secret:
            ts = str(int(time.time()))
            headers["X-Conveyor-Timestamp"] = ts
            headers["X-Conveyor-Signature"] = sign(body, secret, ts)
        host = self._host(url)
        probe = self._may_try(host) if host is not None else False
        if probe is None:
            return (f"webhook host {host[0] if host else ''} let a delivery time out within {SILENT_S:g} s; not tried "
                    f"(one delivery tries it every {PROBE_EVERY_S:g} s)")
        why: str | None = "not sent"
        try:
            why = self._post(url, body, headers, deadline)
        finally:
            if host is not None:
                self._tried(host, why is not None and why.startswith("no answer within"), probe)
        return why

    def _post(self, url: str, body: bytes, headers: dict[str, str], deadline: float) -> str | None:
        timeout = self.settings.webhook_timeout_s
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

    @staticmethod
    def _host(url: str) -> tuple[str, int] | None:
        try:
            host = urlsplit(url).hostname
            return (host, url_port(url)) if host else None
        except ValueError:
            return None

    def _may_try(self, host: tuple[str, int]) -> bool | None:
        """Whether a delivery to `host` may go now: False (yes), unless it let one time out within SILENT_S: then True
        as its one probe (at a time, PROBE_EVERY_S apart), None (no) otherwise."""
        now = time.monotonic()
        with self._silent_lock:
            until, probe_at = self._silent.get(host, (0.0, 0.0))
            if until <= now:
                self._silent.pop(host, None)
                return False
            if host in self._probing or now < probe_at:
                return None
            self._probing.add(host)
            self._silent[host] = (until, now + PROBE_EVERY_S)
            return True

    def _tried(self, host: tuple[str, int], timed_out: bool, probe: bool) -> None:
        with self._silent_lock:
            if probe:
                self._probing.discard(host)
            if timed_out:
                if len(self._silent) >= SILENT_HOSTS_MAX:  # (bounded: the expired first, else the oldest)
                    now = time.monotonic()
                    for h in [h for h, (t, _) in self._silent.items() if t <= now] or list(self._silent)[:1]:
                        del self._silent[h]
                now = time.monotonic()
                self._silent[host] = (now + SILENT_S, now + PROBE_EVERY_S)
            else:
                self._silent.pop(host, None)

    def close(self) -> None:
        """Stop the lookup threads; a lookup under way is left to finish alone."""
        self._lookups.shutdown(wait=False, cancel_futures=True)

    def _lookup(self, host: str, port: int) -> Future[list[IPAddress]]:
        """The host's lookup: the one under way, else a new one."""
        key = (host, port)
        with self._resolving_lock:
            lookup = self._resolving.get(key)
            if lookup is None or lookup.done():
                if len(self._resolving) >= self.lookups_max:
                    raise NotSent(f"webhook host {host} not looked up: {len(self._resolving)} lookups under way")
                lookup = self._resolving[key] = self._lookups.submit(self.resolve, host, port)
                lookup.add_done_callback(lambda done: self._forget_lookup(key, done))
            return lookup

    def _forget_lookup(self, key: tuple[str, int], done: Future[list[IPAddress]]) -> None:
        with self._resolving_lock:
            if self._resolving.get(key) is done:
                del self._resolving[key]

    def _connection(self, url: str, deadline: float) -> tuple[_PinnedConnection, str]:
        """A connection to the webhook's host pinned to its checked addresses, and the request path."""
        try:
            parts = urlsplit(url)
            host, port = parts.hostname, url_port(url)
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
        why = webhook_port_refusal(url, self.settings.webhook_port_set)
        if why:  # (accepted before WEBHOOK_PORTS was set: the network would not let it through)
            raise NotSent(f"webhook {why}; refused")
        lookup = self._lookup(host, port)
        try:
            addresses = lookup.result(timeout=max(deadline - time.monotonic(), 0.0))
        except FutureTimeout:
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
