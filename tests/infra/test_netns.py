"""harness/netns.py: a cut link is a clean partition (an open TCP connection hangs and a new one hangs in its
connect, neither is reset or refused), a heal delivers what the cut held, and a lab leaves nothing behind,
not even when its process died without cleaning up."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading

import pytest

from harness import netns
from harness.stack import ROOT
from tests.helpers import until

pytestmark = pytest.mark.skipif(bool(netns.unavailable()), reason=netns.unavailable() or "")

# run inside the namespace: connect, then report what each step met, one line each, as the test drives it
CLIENT = textwrap.dedent("""
    import socket, sys, time
    host, port = sys.argv[1], int(sys.argv[2])
    s = socket.create_connection((host, port), timeout=3)
    print("connected", flush=True)
    sys.stdin.readline()  # the test has cut the link
    s.sendall(b"ping")
    s.settimeout(1.5)
    try:
        print("recv", s.recv(10), flush=True)
    except Exception as e:
        print("recv-error", type(e).__name__, flush=True)
    t = time.monotonic()
    try:
        socket.create_connection((host, port), timeout=1.5)
        print("connect ok", flush=True)
    except Exception as e:
        print("connect-error", type(e).__name__, round(time.monotonic() - t, 1), flush=True)
    sys.stdin.readline()  # healed
    s.settimeout(30)
    print("after-heal", s.recv(10), flush=True)
""")


def test_a_cut_hangs_connections_and_a_heal_delivers_what_it_held() -> None:
    with netns.NetLab() as lab:
        ns = lab.namespace("probe")
        link = ns.link()
        assert link.subnet.overlaps(netns.SUBNET)
        server = socket.socket()
        server.bind((link.host_ip, 0))
        server.listen()
        port = server.getsockname()[1]
        got: list[bytes] = []

        def serve() -> None:
            conn, _ = server.accept()
            conn.settimeout(60)
            got.append(conn.recv(10))
            conn.sendall(b"pong")
            conn.recv(10)  # until the client closes

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        client = ns.popen([sys.executable, "-c", CLIENT, link.host_ip, str(port)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
        try:
            assert client.stdout is not None and client.stdin is not None
            assert client.stdout.readline().strip() == "connected"
            link.cut()
            client.stdin.write("\n")
            client.stdin.flush()
            # the open connection hangs (no reset, no error): the read times out
            assert client.stdout.readline().split() == ["recv-error", "TimeoutError"]
            # a new connection hangs in its connect (no refusal, no "unreachable") until the client gives up
            line = client.stdout.readline().split()
            assert line[:2] == ["connect-error", "TimeoutError"], line
            assert not got  # nothing crossed the cut
            # the root namespace still reaches the root side's own address (a Redis bound there serves it)
            with socket.create_connection((link.host_ip, port), timeout=2):
                pass
            # and a connect from it into the namespace hangs too (no EINVAL, no "unreachable")
            with pytest.raises(TimeoutError):
                socket.create_connection((link.ns_ip, 9), timeout=1.5)
            link.heal()
            client.stdin.write("\n")
            client.stdin.flush()
            assert client.stdout.readline().strip() == "after-heal b'pong'"  # retransmitted, in order
            assert got[0] == b"ping"  # the first one: the root side's probe connection sent nothing
            assert client.wait(10) == 0
        finally:
            if client.poll() is None:
                client.kill()
            server.close()
        name = ns.name
    assert name not in netns.ip("netns", "list").stdout
    assert link.host_dev not in netns.ip("link", "show").stdout
    assert link.sink_dev not in netns.ip("link", "show").stdout
    assert str(link.subnet) not in netns.ip("route", "show").stdout


def test_a_dead_labs_namespaces_are_removed_by_the_next_lab() -> None:
    # a lab in a process that is killed outright: its namespace, link, route and the process it ran inside stay
    code = textwrap.dedent("""
        import os, subprocess, sys, time
        from harness import netns
        lab = netns.NetLab().__enter__()
        ns = lab.namespace("orphan")
        link = ns.link()
        p = ns.popen(["sleep", "600"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(ns.name, link.host_dev, link.subnet, p.pid, flush=True)
        os.kill(os.getpid(), 9)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.stdout, out.stderr
    name, dev, subnet, pid = out.stdout.split()
    assert name in netns.ip("netns", "list").stdout
    with netns.NetLab():
        pass
    assert name not in netns.ip("netns", "list").stdout
    assert dev not in netns.ip("link", "show").stdout
    assert subnet not in netns.ip("route", "show").stdout
    until("the orphan's process to go", lambda: not _running(int(pid)), timeout=10)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_links_of_concurrent_labs_get_distinct_subnets() -> None:
    with netns.NetLab() as a, netns.NetLab() as b:
        links = [a.namespace("a").link() for _ in range(3)] + [b.namespace("b").link()]
        assert len({link.subnet for link in links}) == len(links)
        assert len({link.host_dev for link in links}) == len(links)
