"""tests/hosts.py: separate hosts (network namespaces on a bridge) that reach each other and nothing
else, die and come back, hide paths from a process, and leave nothing behind, not even when the
session that made them is killed. Root only: skipped elsewhere, failed in CI (tests.support.need_netns)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import urllib.request
from ipaddress import ip_address
from pathlib import Path

import pytest

import tests.hosts as hosts_mod
from tests.hosts import Hosts, HostsError, clean_leftovers, present
from tests.support import REPO, hosts_fixture, need_netns, wait_for

pytestmark = pytest.mark.unit

two_hosts = hosts_fixture(2)

# A TCP server that answers each connection with the client's address, and its client.
PEER_SERVER = "\n".join([
    "import socket, sys",
    "s = socket.create_server((sys.argv[1], int(sys.argv[2])))",
    "while True:",
    "    c, a = s.accept(); c.sendall(a[0].encode()); c.close()",
])  # fmt: skip
PEER_CLIENT = (
    "import socket as so, sys; print(so.create_connection((sys.argv[1], sys.argv[2]), 5).recv(64).decode())"
)
FETCH = "import sys, urllib.request as u; print(u.urlopen(sys.argv[1], timeout=5).read().decode())"
# Connects to port 80 of argv[1]; a failure raises (its error names why: unreachable, refused, timed out).
CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], 80), 5)"


@pytest.fixture(autouse=True)
def _needs_netns():
    need_netns()


def gone(pid: int) -> bool:
    """The process has exited (a zombie counts: it runs nothing and holds no namespace)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def daemon(host) -> int:
    """Start `sleep` in `host` in a session of its own (out of reach of the groups `run` started) and
    return its pid."""
    return int(host.check_output(["sh", "-c", "setsid sleep 600 </dev/null >/dev/null 2>&1 & echo $!"]))


def http_server(host, port: int = 8000):
    return host.serve([sys.executable, "-m", "http.server", str(port), "-b", host.address], port,
                      cwd=REPO / "tests")  # fmt: skip


def test_hosts_reach_each_other_and_the_root_namespace_reaches_them_through_the_bridge(two_hosts):
    """An HTTP server in A, bound to A's address, serves B and the root namespace; a server in B sees
    A's connection come from A's own address and the root namespace's from the bridge's address: each
    went over the bridge from the side that sent it."""
    a, b = two_hosts
    assert a.address != b.address and {ip_address(a.address), ip_address(b.address)} <= set(two_hosts.subnet)
    http_server(a)
    assert "conftest.py" in b.check_output([sys.executable, "-c", FETCH, a.url(8000, "/")])
    assert "conftest.py" in urllib.request.urlopen(a.url(8000, "/"), timeout=5).read().decode()
    b.serve([sys.executable, "-c", PEER_SERVER, b.address, "9000"], 9000)
    assert a.check_output([sys.executable, "-c", PEER_CLIENT, b.address, "9000"]).strip() == a.address
    with socket.create_connection((b.address, 9000), timeout=5) as s:
        assert s.recv(64).decode() == str(next(two_hosts.subnet.hosts()))  # 10.R.S.1, the bridge's


def test_a_host_routes_only_its_subnet_and_reaches_nothing_else(two_hosts):
    """Inside a host the only route is the subnet's link route (no default route, no IPv6): connecting
    off the subnet fails at once with "Network is unreachable", before any packet leaves. The bridge
    forwards nothing off itself, which `ip route get ... iif` shows without sending a packet."""
    a = two_hosts[0]
    routes = json.loads(a.check_output(["ip", "-j", "route"]))
    assert routes == [{"dst": str(two_hosts.subnet), "dev": "eth0", "protocol": "kernel", "scope": "link",
                       "prefsrc": a.address, "flags": []}]  # fmt: skip
    assert json.loads(a.check_output(["ip", "-j", "-6", "route"]) or "[]") == []
    for target in ("10.255.255.1", "203.0.113.1", "8.8.8.8"):
        with pytest.raises(subprocess.CalledProcessError) as failed:
            a.check_output([sys.executable, "-c", CONNECT, target])
        # ENETUNREACH: refused by the call itself, before any packet leaves (a sent packet that nothing
        # answers would end in a connect timeout instead)
        assert "Network is unreachable" in failed.value.stderr, failed.value.stderr
    bridge = two_hosts.bridge
    assert Path(f"/proc/sys/net/ipv4/conf/{bridge}/forwarding").read_text().strip() == "0"
    forwarded = subprocess.run(["ip", "route", "get", "203.0.113.1", "from", a.address, "iif", bridge],
                               capture_output=True, text=True)  # fmt: skip
    assert forwarded.returncode != 0, forwarded.stdout


def test_nothing_starts_in_a_host_unless_its_routes_are_the_bridge_alone(two_hosts):
    """A blackhole route for a host's address in the root namespace (packets to it are dropped), or a
    default route inside the host, makes the harness refuse to start anything there."""
    a, b = two_hosts
    subprocess.run(["ip", "route", "add", "blackhole", f"{a.address}/32"], check=True)
    try:
        with pytest.raises(HostsError, match="not routed through"):
            a.run(["true"])
        b.check_output(["true"])  # the other host is still fine
    finally:
        subprocess.run(["ip", "route", "del", "blackhole", f"{a.address}/32"], check=True)
    subprocess.run(["ip", "-n", b.name, "route", "add", "default", "dev", "eth0"], check=True)
    with pytest.raises(HostsError, match="not the subnet's link route alone"):
        b.run(["true"])
    subprocess.run(["ip", "-n", b.name, "route", "del", "default"], check=True)
    assert b.check_output(["echo", "ok"]) == "ok\n"


def test_kill_leaves_no_process_and_silence_and_revive_serves_again(two_hosts):
    """kill() SIGKILLs everything in the host at once (the server, a daemon in its own session) and
    the address goes silent like a dead machine's (no refusal either); the host refuses work until
    revive(), after which a new server answers at the same address. The other host is untouched."""
    a, b = two_hosts
    server = http_server(a)
    other = http_server(b)
    sleeper = daemon(a)
    assert str(sleeper) in hosts_mod._ip("netns", "pids", a.name).split()
    a.kill()
    assert hosts_mod._ip("netns", "pids", a.name).split() == []
    assert server.returncode == -signal.SIGKILL
    wait_for(lambda: gone(sleeper), 10, "the daemon to be reaped")
    assert not a.answers(8000, timeout_s=1)
    a.hosts.check_routes(a)  # the bridge's route, checked as answers() checks it before it sends
    with pytest.raises(TimeoutError):  # silence (eth0 is down), not a refusal (ConnectionRefusedError)
        socket.create_connection((a.address, 8000), timeout=1).close()
    for refused in (lambda: a.run(["true"]), lambda: a.url(8000), lambda: a.wait_port(8000)):
        with pytest.raises(HostsError, match="is down"):
            refused()
    assert other.poll() is None and b.answers(8000)
    a.revive()
    assert not a.answers(8000)  # nothing of the old server came back
    http_server(a)
    assert "conftest.py" in b.check_output([sys.executable, "-c", FETCH, a.url(8000, "/")])


def test_a_hidden_path_is_empty_to_that_process_alone(two_hosts, tmp_path):
    """run(hide=...) covers a directory (and a file) with an empty read-only tmpfs for that process:
    the file under it exists in the root namespace and for an unhidden process in the same host, not
    for the hidden one, and the cover does not leak back into the root namespace."""
    a = two_hosts[0]
    store = tmp_path / "store"
    store.mkdir()
    (store / "secret").write_text("weights")
    elsewhere = tmp_path / "key"
    elsewhere.write_text("k3y")
    read = [sys.executable, "-c", "import pathlib,sys; print(pathlib.Path(sys.argv[1]).read_text())"]
    assert a.check_output([*read, str(store / "secret")]) == "weights\n"
    with pytest.raises(subprocess.CalledProcessError) as failed:
        a.check_output([*read, str(store / "secret")], hide=[store])
    assert "No such file" in failed.value.stderr
    assert a.check_output(["ls", "-A", str(store)], hide=[store, elsewhere]) == ""
    assert a.check_output([*read, str(elsewhere)], hide=[store, elsewhere]) == "\n"
    with pytest.raises(subprocess.CalledProcessError):
        a.check_output(["touch", str(store / "new")], hide=[store])
    assert sorted(p.name for p in store.iterdir()) == ["secret"] and elsewhere.read_text() == "k3y"
    with pytest.raises(HostsError, match="cannot hide"):
        a.run(["true"], hide=[tmp_path / "missing"])


def test_teardown_leaves_nothing_also_when_the_body_raises():
    """Leaving the context by an exception kills the hosts' processes (also a daemon no `run` started)
    and deletes namespaces, veths, bridge and marker; stop() again is a no-op that checks the same."""
    with pytest.raises(RuntimeError, match="boom"), Hosts(2) as hosts:
        names = hosts.names()
        sleeper = hosts[1].run(["sleep", "600"])
        detached = daemon(hosts[0])
        assert set(names) <= present() and hosts.marker.exists()
        raise RuntimeError("boom")
    assert sleeper.returncode == -signal.SIGKILL
    wait_for(lambda: gone(detached), 10, "the daemon to be reaped")
    assert not set(names) & present() and not hosts.marker.exists()
    hosts.stop()
    for refused in (lambda: hosts[0].run(["true"]), lambda: hosts[0].url(1), lambda: hosts[0].answers(1)):
        with pytest.raises(HostsError, match="hosts are down"):
            refused()


def test_methods_refuse_a_harness_not_started():
    """Before start nothing reaches a host: no command, no URL, no probe, no kill."""
    hosts = Hosts(1)
    host = hosts[0]
    calls = [lambda: host.run(["true"]), lambda: host.check_output(["true"]), lambda: host.url(80),
             lambda: host.wait_port(80, 1), lambda: host.answers(80), host.kill, host.revive]  # fmt: skip
    for call in calls:
        with pytest.raises(HostsError, match="hosts are down"):
            call()


def test_two_harnesses_take_separate_subnets_and_a_failed_start_leaves_nothing(monkeypatch):
    """A second harness beside a first picks a subnet the first's route does not cover, and its hosts
    cannot reach the first's; when no candidate is free, start refuses and leaves nothing."""
    with Hosts(1) as first, Hosts(1) as second:
        assert not first.subnet.overlaps(second.subnet)
        with pytest.raises(subprocess.CalledProcessError) as failed:
            second[0].check_output([sys.executable, "-c", CONNECT, first[0].address])
        assert "Network is unreachable" in failed.value.stderr
        monkeypatch.setattr(hosts_mod, "CANDIDATES", [first.subnet])
        third = Hosts(1)
        with pytest.raises(HostsError, match="no free subnet"):
            third.start()
        assert not set(third.names()) & present() and not third.marker.exists()


CHILD = """
import json, sys, time
from tests.hosts import Hosts
hosts = Hosts(1, prefix="gfk")
hosts.start()
sleeper = hosts[0].run(["sleep", "600"])
print(json.dumps({"names": hosts.names(), "sleeper": sleeper.pid}), flush=True)
time.sleep(600)
"""


def killed_session(sig: int) -> tuple[subprocess.Popen, list[str], int]:
    """A Python process that brings up one host running `sleep`, then dies of `sig`."""
    child = subprocess.Popen([sys.executable, "-c", CHILD], cwd=REPO, stdout=subprocess.PIPE, text=True)
    made = json.loads(child.stdout.readline() or "null")
    assert made is not None, f"the child exited ({child.wait()}) before bringing its host up"
    os.kill(child.pid, sig)
    child.wait(timeout=30)
    return child, made["names"], made["sleeper"]


def test_a_terminated_session_tears_its_hosts_down():
    """SIGTERM to the session (what a CI runner sends on cancel) tears the hosts down, processes
    included, and the session still dies of SIGTERM."""
    child, names, sleeper = killed_session(signal.SIGTERM)
    assert child.returncode == -signal.SIGTERM
    assert not set(names) & present()
    wait_for(lambda: gone(sleeper), 10, "the sleeper to be reaped")


def test_a_killed_sessions_leftovers_are_removed_at_the_next_start():
    """A SIGKILLed session leaves its namespace, veth, bridge and running process behind; the next
    start with that prefix finds its owner dead and removes all of it."""
    _, names, sleeper = killed_session(signal.SIGKILL)
    try:
        assert set(names) <= present() and not gone(sleeper)
        with Hosts(1, prefix="gfk") as hosts:
            assert not set(names) & present() and hosts.subnet is not None
        wait_for(lambda: gone(sleeper), 10, "the leftover sleeper to die")
    finally:
        clean_leftovers("gfk")


def fake_run(run_id: str, pid: int, start: str | None) -> list[str]:
    """What a run `run_id` of prefix gfz owned by `pid` would leave: a namespace, a bridge, a marker."""
    names = [f"gfzh{run_id}-0", f"gfzbr{run_id}"]
    subprocess.run(["ip", "netns", "add", names[0]], check=True)
    subprocess.run(["ip", "link", "add", names[1], "type", "bridge"], check=True)
    (hosts_mod.RUN_DIR / f"gfz{run_id}.json").write_text(json.dumps({"pid": pid, "start": start}))
    return names


def test_leftovers_of_a_dead_owner_go_those_of_a_live_one_stay_and_what_resists_stops_the_start(
    monkeypatch,
):
    """Leftovers whose marker names a process that has exited are removed at start; those of a live
    owner (this process) are left alone; if removing fails, start refuses and names them."""
    hosts_mod.RUN_DIR.mkdir(parents=True, exist_ok=True)
    dead = subprocess.Popen(["true"])
    dead_start = hosts_mod._start_time(dead.pid)
    dead.wait()
    dead_id, live_id = secrets.token_hex(3), secrets.token_hex(3)
    dead_names = fake_run(dead_id, dead.pid, dead_start)
    live_names = fake_run(live_id, os.getpid(), hosts_mod._start_time(os.getpid()))
    try:
        with monkeypatch.context() as m:
            m.setattr(hosts_mod, "_remove", lambda kind, name: None)
            with pytest.raises(HostsError, match="could not be removed") as refused:
                Hosts(1, prefix="gfz").start()
            assert all(n in str(refused.value) for n in dead_names)
        with Hosts(1, prefix="gfz"):
            assert not set(dead_names) & present() and set(live_names) <= present()
        assert not (hosts_mod.RUN_DIR / f"gfz{dead_id}.json").exists()
        assert (hosts_mod.RUN_DIR / f"gfz{live_id}.json").exists()
    finally:
        subprocess.run(["ip", "netns", "del", live_names[0]], check=False)
        subprocess.run(["ip", "link", "del", live_names[1]], check=False)
        (hosts_mod.RUN_DIR / f"gfz{live_id}.json").unlink(missing_ok=True)
        clean_leftovers("gfz")
