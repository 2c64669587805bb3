"""Webhooks cannot reach inside: hosts are resolved at send time and refused if any address is
loopback, private, link-local, metadata and the like; the connection goes to the checked address;
one deadline covers the whole delivery. On a real Redis, with real HTTP(S) receivers."""

from __future__ import annotations

import ipaddress
import logging
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from shared import names
from shared.settings import Settings
from tests.webhook_server import webhook_server
from tests.workers.test_after_job import end_job
from workers.after_job import AfterJob
from workers.webhook import LOOKUPS_PER_THREAD, IPAddress, WebhookSender, address_refusal, redact


def settings_for(allow_private: bool, **settings: Any) -> Settings:
    return Settings(webhook_retry_s=0, webhook_attempts=3, webhook_allow_private=allow_private, **settings)


def after(r: redis.Redis, allow_private: bool, **settings: Any) -> AfterJob:
    return AfterJob(r, settings_for(allow_private, **settings), consumer="reach-test")


def sender(r: redis.Redis, allow_private: bool, **settings: Any) -> WebhookSender:
    return WebhookSender(r, settings_for(allow_private, **settings))


def pinned(table: dict[str, list[str]], calls: list[str]) -> Any:
    """A resolver that knows only `table` and counts its lookups."""

    def resolve(host: str, port: int) -> list[IPAddress]:
        calls.append(host)
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [ipaddress.ip_address(a) for a in table[host]]

    return resolve


@pytest.mark.parametrize(("address", "refused_as"), [
    ("127.0.0.1", "loopback"), ("127.255.0.9", "loopback"), ("::1", "loopback"),
    ("10.1.2.3", "private"), ("172.16.0.1", "private"), ("192.168.1.1", "private"), ("fc00::1", "private"),
    ("fd12:3456::1", "private"), ("fec0::1", "private"),
    ("169.254.1.1", "link-local"), ("fe80::1", "link-local"),
    ("169.254.169.254", "a cloud metadata address"), ("fd00:ec2::254", "a cloud metadata address"),
    ("169.254.170.2", "a cloud metadata address"), ("100.100.100.200", "a cloud metadata address"),
    ("168.63.129.16", "a cloud metadata address"),
    ("0.0.0.0", "unspecified"), ("::", "unspecified"),
    ("224.0.0.1", "multicast"), ("239.255.255.250", "multicast"), ("ff02::1", "multicast"),
    ("240.0.0.1", "reserved"), ("255.255.255.255", "reserved"),
    ("100.64.0.1", "not a public address"),
    # IPv4 inside IPv6: mapped, 6to4, NAT64; and the deprecated IPv4-compatible form
    ("::ffff:127.0.0.1", "loopback"), ("::ffff:10.0.0.1", "private"),
    ("::ffff:169.254.169.254", "a cloud metadata address"), ("2002:7f00:1::1", "loopback"),
    ("64:ff9b::a00:1", "private"), ("::7f00:1", "reserved"),
    ("8.8.8.8", None), ("1.1.1.1", None), ("2606:4700:4700::1111", None), ("::ffff:8.8.8.8", None),
])
def test_address_refusal(address: str, refused_as: str | None) -> None:
    assert address_refusal(ipaddress.ip_address(address)) == refused_as


def test_address_refusal_for_local_development() -> None:
    allowed = ["127.0.0.1", "::1", "10.0.0.1", "192.168.1.1", "fc00::1", "169.254.1.1", "::ffff:127.0.0.1"]
    assert all(address_refusal(ipaddress.ip_address(a), allow_private=True) is None for a in allowed)
    for address, why in [("169.254.169.254", "a cloud metadata address"), ("fd00:ec2::254", "a cloud metadata address"),
                         ("0.0.0.0", "unspecified"), ("224.0.0.1", "multicast"), ("240.0.0.1", "reserved")]:
        assert address_refusal(ipaddress.ip_address(address), allow_private=True) == why


def test_redact() -> None:
    assert redact("https://hooks.example.com/a/b?token=s3cret") == "https://hooks.example.com/…"
    assert redact("http://127.0.0.1:8080/hook?x=1#f") == "http://127.0.0.1:8080/…"
    assert redact("http://[::1]:9000/p") == "http://[::1]:9000/…"
    assert redact("http://user:pw@example.com/p") == "http://example.com/…"
    assert redact("http://example.com:99999/") == "<invalid URL>"
    assert redact("file:///etc/passwd") == "<invalid URL>"


def test_inside_targets_are_refused_and_dead_lettered(redis_db: redis.Redis,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    worker = after(redis_db, allow_private=False)
    with webhook_server() as hooks:
        targets = {
            "job_v4": (f"{hooks.url}?token=s3cret", "webhook address 127.0.0.1 is loopback; refused"),
            "job_v6": (f"http://[::1]:{hooks.port}/hook", "webhook address ::1 is loopback; refused"),
            "job_meta": ("http://169.254.169.254/latest/meta-data/",
                         "webhook address 169.254.169.254 is a cloud metadata address; refused"),
            "job_name": (f"http://localhost:{hooks.port}/hook", "is loopback; refused"),  # resolves to 127.0.0.1/::1
            "job_mapped": (f"http://[::ffff:127.0.0.1]:{hooks.port}/hook",
                           "webhook address ::ffff:127.0.0.1 is loopback; refused"),
        }
        for job_id, (url, _) in targets.items():
            end_job(redis_db, job_id, url)
        with caplog.at_level(logging.WARNING):
            results = [worker.drain() for _ in range(4)]
        n = len(targets)
        assert [c["failed"] for c in results] == [n, n, n, 0] and results[3]["dead"] == n
        # every try ended in its refusal (the reasons below), before any connection: none is on its way
        assert hooks.received == []  # nothing arrived, not even once
    dead = {d["job_id"]: d["reason"] for _, d in redis_db.xrange(names.stream(names.DEAD, 0))}
    assert set(dead) == set(targets)
    for job_id, (_, why) in targets.items():
        assert dead[job_id].startswith("delivered 3 times without completing; last webhook failure: webhook ")
        assert dead[job_id].endswith(why), dead[job_id]
        assert redis_db.hget(names.job_key(job_id), "webhook_error").endswith(why)  # type: ignore[union-attr]
    assert redis_db.hget(names.usage_key(), "m:jobs") == str(len(targets))  # accounted all the same
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert f"job_v4 to http://127.0.0.1:{hooks.port}/…: webhook address 127.0.0.1 is loopback; refused" in logged
    assert f"http://[::1]:{hooks.port}/…" in logged and "http://169.254.169.254/…" in logged
    assert "s3cret" not in logged and "/hook" not in logged and "meta-data" not in logged


def test_inside_targets_are_allowed_for_local_development(redis_db: redis.Redis) -> None:
    worker = after(redis_db, allow_private=True)
    with webhook_server() as hooks:
        end_job(redis_db, "job_local", hooks.url)
        end_job(redis_db, "job_localhost", f"http://localhost:{hooks.port}/hook")  # ::1 first, maybe: nothing there
        end_job(redis_db, "job_meta", "http://169.254.169.254/latest/meta-data/")  # still refused
        assert worker.drain() == {"done": 2, "failed": 1, "dead": 0}
        received = {h["x-conveyor-job"]: h for h, _, _ in hooks.wait_for(2, timeout=5)}
    assert set(received) == {"job_local", "job_localhost"}
    assert received["job_localhost"]["host"] == f"localhost:{hooks.port}"
    assert redis_db.hget(names.job_key("job_meta"), "webhook_error") == (
        "webhook address 169.254.169.254 is a cloud metadata address; refused")


def test_one_refused_address_refuses_the_host(redis_db: redis.Redis) -> None:
    calls: list[str] = []
    worker = sender(redis_db, allow_private=False)
    worker.resolve = pinned({"mixed.example.test": ["93.184.215.14", "10.0.0.7"],
                             "rebind.example.test": ["2606:4700::6810:84e5", "::ffff:192.168.0.1"]}, calls)
    assert worker.post("http://mixed.example.test/hook", b"{}", "job_x") == (
        "webhook address 10.0.0.7 is private; refused")
    assert worker.post("https://rebind.example.test/hook", b"{}", "job_x") == (
        "webhook address ::ffff:192.168.0.1 is private; refused")
    assert worker.post("http://nowhere.example.test/", b"{}", "job_x").startswith(  # type: ignore[union-attr]
        "webhook host nowhere.example.test did not resolve")
    assert worker.post("ftp://example.com/", b"{}", "job_x") == "webhook URL is not http(s)://host/...; refused"
    assert worker.post("http://u:p@example.com/", b"{}", "job_x") == "webhook URL carries credentials; refused"
    assert calls == ["mixed.example.test", "rebind.example.test", "nowhere.example.test"]


def test_a_port_outside_webhook_ports_is_refused_before_any_lookup(redis_db: redis.Redis) -> None:
    """WEBHOOK_PORTS (the ports the network lets the worker reach): a job accepted with another port before it was set
    is not sent, saying why, rather than tried against a wall until its tries run out."""
    calls: list[str] = []
    worker = sender(redis_db, allow_private=True, webhook_ports="80, 443")
    worker.resolve = pinned({"hooks.example.test": ["127.0.0.1"]}, calls)
    assert worker.post("http://hooks.example.test:8080/hook", b"{}", "job_x") == (
        "webhook port 8080 is not one webhooks are sent to here (80, 443: WEBHOOK_PORTS); refused")
    assert worker.post("https://hooks.example.test:80/hook", b"{}", "job_x") != (  # the port named, not the scheme's
        "webhook port 80 is not one webhooks are sent to here (80, 443: WEBHOOK_PORTS); refused")
    assert calls == ["hooks.example.test"]


def test_the_connection_goes_to_the_checked_address(redis_db: redis.Redis) -> None:
    """The name resolves once, through the check; the connection uses that address (this name is
    unknown to any real resolver) while the Host header carries the name."""
    calls: list[str] = []
    worker = after(redis_db, allow_private=True)
    with webhook_server() as hooks:
        worker.webhooks.resolve = pinned({"hooks.example.test": ["127.0.0.1"]}, calls)
        end_job(redis_db, "job_pinned", f"http://hooks.example.test:{hooks.port}/hook?a=1")
        assert worker.drain() == {"done": 1, "failed": 0, "dead": 0}
        [(headers, body, _)] = hooks.wait_for(1, timeout=5)
    assert calls == ["hooks.example.test"]
    assert headers["host"] == f"hooks.example.test:{hooks.port}" and body["id"] == "job_pinned"


def slow_server(step_s: float) -> tuple[socket.socket, int]:
    """Accepts, then answers one byte every step_s: each read is quick, the whole answer is not."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return

            def trickle(c: socket.socket = conn) -> None:
                try:
                    c.recv(65536)
                    for byte in b"HTTP/1.1 204 No Content\r\n\r\n":
                        c.sendall(bytes([byte]))
                        time.sleep(step_s)
                except OSError:
                    pass
                finally:
                    c.close()

            threading.Thread(target=trickle, daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return server, server.getsockname()[1]


def test_one_deadline_covers_the_whole_delivery(redis_db: redis.Redis) -> None:
    worker = sender(redis_db, allow_private=True, webhook_timeout_s=0.5)
    server, port = slow_server(0.2)  # the whole answer would take about 5 s
    try:
        t0 = time.monotonic()
        assert worker.post(f"http://127.0.0.1:{port}/hook", b"{}", "job_slow") == "no answer within 0.5 s"
        assert 0.45 < time.monotonic() - t0 < 2
    finally:
        server.close()

    released = threading.Event()

    def hanging_lookup(host: str, port: int) -> list[IPAddress]:
        released.wait(30)  # a resolver that does not answer, until the test lets it go
        return [ipaddress.ip_address("127.0.0.1")]

    worker.resolve = hanging_lookup
    try:
        t0 = time.monotonic()
        assert worker.post("http://slow-dns.example.test/", b"{}", "job_x") == (
            "webhook host slow-dns.example.test did not resolve within 0.5 s")
        assert time.monotonic() - t0 < 2
    finally:
        released.set()
        worker.close()


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """A self-signed certificate for hooks.example.test (and no IP address)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-keyout", str(key),
                    "-out", str(cert), "-subj", "/CN=hooks.example.test",
                    "-addext", "subjectAltName=DNS:hooks.example.test"], check=True, capture_output=True)
    yield cert, key


def test_https_checks_the_certificate_against_the_name(redis_db: redis.Redis,
                                                       certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)
    worker = sender(redis_db, allow_private=True)
    worker.resolve = pinned({"hooks.example.test": ["127.0.0.1"], "other.example.test": ["127.0.0.1"],
                             "127.0.0.1": ["127.0.0.1"]}, [])
    with webhook_server(tls=server_tls) as hooks:
        url = f"https://hooks.example.test:{hooks.port}/hook"
        # not trusted yet: the system's authorities do not know this certificate
        assert "CERTIFICATE_VERIFY_FAILED" in (worker.post(url, b"{}", "job_x") or "")
        worker.tls = ssl.create_default_context(cafile=str(cert))
        assert worker.post(url, b"{}", "job_tls") is None  # SNI and the check use the name, not the address
        wrong = worker.post(f"https://other.example.test:{hooks.port}/hook", b"{}", "job_x") or ""
        assert "CERTIFICATE_VERIFY_FAILED" in wrong and "other.example.test" in wrong
        assert "CERTIFICATE_VERIFY_FAILED" in (worker.post(hooks.url, b"{}", "job_x") or "")  # by IP: no match
        [(headers, _, _)] = hooks.wait_for(1, timeout=5)
    assert headers["host"] == f"hooks.example.test:{hooks.port}" and headers["x-conveyor-job"] == "job_tls"


def test_a_name_whose_servers_never_answer_holds_one_lookup_not_all(redis_db: redis.Redis) -> None:
    """One tenant's webhook host does not resolve in time (its name servers never answer; getaddrinfo has no
    timeout): its deliveries share one lookup under way, so another tenant's webhook still resolves and goes."""
    release = threading.Event()
    calls: list[str] = []

    def resolve(host: str, port: int) -> list[IPAddress]:
        calls.append(host)
        if host == "slow.example.test":
            release.wait(20)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return [ipaddress.ip_address("127.0.0.1")]

    worker = AfterJob(redis_db, settings_for(True, webhook_timeout_s=1), consumer="after-dns", parallel=4)
    worker.webhooks.resolve = resolve
    try:
        with webhook_server() as hooks:
            for i in range(6):
                end_job(redis_db, f"job_slow_{i}", "http://slow.example.test/hook", owner="a")
            end_job(redis_db, "job_good", hooks.url.replace("127.0.0.1", "good.example.test"), owner="b")
            counts = worker.drain()
            assert [body["id"] for _, body, _ in hooks.received] == ["job_good"], counts
            assert calls.count("slow.example.test") == 1  # one lookup, shared by its six deliveries
    finally:
        release.set()
        worker.close()


def test_lookups_of_hosts_that_never_answer_are_bounded(redis_db: redis.Redis) -> None:
    """Deliveries to many distinct names whose servers never answer (a domain's random subdomains): the lookups
    under way or queued stay within LOOKUPS_PER_THREAD a thread; past it a delivery fails at once, to be tried
    again later, rather than queueing a lookup behind the others."""
    release = threading.Event()

    def resolve(host: str, port: int) -> list[IPAddress]:
        release.wait(20)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    worker = WebhookSender(redis_db, settings_for(True, webhook_timeout_s=0.05), parallel=2)
    worker.resolve = resolve
    try:
        why = [worker.post(f"http://h{i}.slow.example.test/hook", b"{}", f"job_{i}") for i in range(30)]
        assert len(worker._resolving) == worker.lookups_max == LOOKUPS_PER_THREAD * 2
        assert why[0] == "webhook host h0.slow.example.test did not resolve within 0.05 s"
        assert why[-1] == f"webhook host h29.slow.example.test not looked up: {worker.lookups_max} lookups under way"
    finally:
        release.set()
        worker.close()
