"""Separate hosts on this one machine, for tests and benchmarks: Linux network namespaces (`ip netns`)
joined by a Linux bridge through veth pairs. Root only; the standard library and `ip` / `unshare` only.
`with Hosts(2) as (a, b): a.serve([...], 8000); b.check_output([..., a.url(8000)])`; tests/support.py's
hosts_fixture makes a pytest fixture of it, and tests/unit/test_hosts.py shows the rest.

Safety rules, each enforced here (tests/unit/test_hosts.py tests them):
1. Every packet stays on the bridge. The subnet is a /24 of 10.0.0.0/8 that no address or route of this
   machine touches; hosts have no default route and no IPv6; the bridge forwards nothing off itself
   (its IPv4 `forwarding` is 0); before any process starts in a host, and before the harness connects
   to one, `ip route get` must send the host's address out through the bridge and the host's own
   routing table must hold the subnet's link route alone.
2. Nothing is sent to the subnet while it is down: every method that reaches a host raises unless the
   harness is up (and, but for `answers`, the host alive).
3. The harness itself only ever connects to the hosts' addresses.
4. Teardown (context exit, `stop`, atexit, SIGTERM) kills every process in the namespaces, deletes
   namespaces, veths and bridge, is idempotent and verifies that nothing of its own is left.
5. `start` removes what an earlier run whose owner is dead left (marker files under RUN_DIR name the
   owner's pid and start time), and refuses to start, naming them, if it cannot.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import ipaddress
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

RUN_DIR = Path("/run/grpoflow-hosts")
# Tried in order; the first that no address or route of this machine overlaps is used.
CANDIDATES = [ipaddress.ip_network(f"10.213.{s}.0/24") for s in range(240, 248)]
# `sh` in a private mount namespace: an empty read-only tmpfs over each hidden directory, /dev/null
# over each hidden file, then the command.
_HIDE_SH = 'set -e; while [ "$1" != -- ]; do if [ -d "$1" ]; then mount -t tmpfs -o ro,size=4k,mode=0555 '
_HIDE_SH += 'gf-hidden "$1"; else mount --bind /dev/null "$1"; fi; shift; done; shift; exec "$@"'
_UNSHARE = ["unshare", "--mount", "--propagation", "private", "sh", "-c", _HIDE_SH, "sh"]
_LIVE: set[Hosts] = set()
_handlers: list = []  # the SIGTERM handler in place before ours, once ours is installed


class HostsError(RuntimeError):
    """The harness refused (a safety check failed, a host is down) or could not clean up."""


def _ip(*args: str, ns: str | None = None, check: bool = True) -> str:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and r.returncode:
        raise HostsError(f"`{' '.join(cmd)}` failed: {r.stderr.strip()}")
    return r.stdout


def _ip_json(*args: str, ns: str | None = None) -> list[dict]:
    return json.loads(_ip("-j", *args, ns=ns) or "[]")  # `ip -j` prints nothing for an empty list


def present() -> set[str]:
    """The names of every network namespace and every link of the root namespace."""
    return {e["name"] for e in _ip_json("netns", "list")} | {e["ifname"] for e in _ip_json("link")}


def _start_time(pid: int) -> str | None:
    """Its start time (/proc/PID/stat field 22): with the pid, one process even where pids are reused."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _sysctl(path: str, value: str) -> None:
    p = Path("/proc/sys/net") / path
    if p.parent.exists():  # no /proc/sys/net/ipv6 where IPv6 is off in the kernel
        p.write_text(value)


def _kill_ns(ns: str, timeout_s: float = 10.0) -> None:
    """SIGKILL every process in namespace `ns`, round after round (a fork in between), until none is left."""
    deadline = time.monotonic() + timeout_s
    while pids := [int(p) for p in _ip("netns", "pids", ns, check=False).split()]:
        if time.monotonic() > deadline:
            raise HostsError(f"processes {pids} in {ns} survive SIGKILL")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)


def _remove(kind: str, name: str) -> None:
    """Delete one namespace (its processes killed first) or one link; what is already gone is fine."""
    if name in present():
        if kind == "netns":
            _kill_ns(name)
        _ip(kind, "del", name, check=False)


def _owned(prefix: str) -> dict[str, list[tuple[str, str]]]:
    """Namespaces and links named by the harness with `prefix`, by run id."""
    pattern = re.compile(rf"{re.escape(prefix)}(br|h|v)([0-9a-f]{{6}})(?:-\d+)?")
    found: dict[str, list[tuple[str, str]]] = {}
    for name in present():
        if m := pattern.fullmatch(name):
            found.setdefault(m[2], []).append(("netns" if m[1] == "h" else "link", name))
    return found


def _owner_alive(marker: Path) -> bool:
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        owner = json.loads(marker.read_text())
        return owner["start"] is not None and _start_time(owner["pid"]) == owner["start"]
    return False


def clean_leftovers(prefix: str = "gf") -> list[str]:
    """Remove what runs with `prefix` whose owner is dead left (processes, namespaces, links, marker
    files) and return their names; raise HostsError naming what could not be removed."""
    found, marker = _owned(prefix), re.compile(rf"{re.escape(prefix)}([0-9a-f]{{6}})\.json")
    runs = {m[1] for m in map(marker.fullmatch, os.listdir(RUN_DIR)) if m} | set(found)
    dead = {run for run in runs if not _owner_alive(RUN_DIR / f"{prefix}{run}.json")}
    leftovers = sorted((e for run in dead for e in found.get(run, [])), key=lambda e: e[0] != "netns")
    for kind, name in leftovers:  # namespaces (and their processes) first
        _remove(kind, name)
    if left := [name for run, items in _owned(prefix).items() if run in dead for _, name in items]:
        raise HostsError(f"an earlier run left {left} and they could not be removed; remove them by hand")
    for run in dead:
        (RUN_DIR / f"{prefix}{run}.json").unlink(missing_ok=True)
    return [name for _, name in leftovers]


def _free_subnet() -> ipaddress.IPv4Network:
    """The first of CANDIDATES that no address or route (any table) of the root namespace overlaps."""
    addrs = [a for link in _ip_json("addr") for a in link.get("addr_info", [])]
    taken = [ipaddress.ip_interface(f"{a['local']}/{a['prefixlen']}").network for a in addrs]
    for route in _ip_json("route", "show", "table", "all"):
        if route.get("dst", "default") != "default":
            with contextlib.suppress(ValueError):
                taken.append(ipaddress.ip_network(route["dst"], strict=False))
    for net in CANDIDATES:
        if not any(net.version == t.version and net.overlaps(t) for t in taken):
            return net
    raise HostsError(f"no free subnet: each of {[str(c) for c in CANDIDATES]} overlaps an address or route")


def _stop_all() -> None:
    for hosts in list(_LIVE):
        try:
            hosts.stop()
        except Exception as e:  # the others still go
            print(f"grpoflow hosts: teardown of {hosts.bridge} failed: {e}", file=sys.stderr)


def _on_sigterm(signum, frame) -> None:
    _stop_all()
    previous = _handlers[0]
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:  # the default: die of SIGTERM, as without us
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _install_handlers() -> None:
    if not _handlers:
        atexit.register(_stop_all)
        with contextlib.suppress(ValueError):  # not the main thread: atexit and context exit still hold
            _handlers.append(signal.signal(signal.SIGTERM, _on_sigterm))


class Host:
    """One host: namespace `name`, interface eth0 at `address`, joined to the bridge by veth `veth`."""

    def __init__(self, hosts: Hosts, index: int):
        self.hosts, self.index = hosts, index
        self.name = f"{hosts.prefix}h{hosts.id}-{index}"
        self.veth = f"{hosts.prefix}v{hosts.id}-{index}"
        self.address, self.alive, self._procs = "", False, []  # _procs: what `run` started

    def __repr__(self) -> str:
        return f"Host({self.name}, {self.address or 'no address'}, {'alive' if self.alive else 'down'})"

    def _reap(self) -> None:
        """Wait for the processes `run` started (killed with the namespace; a group that left it, now)."""
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        self._procs.clear()

    def _check(self) -> None:
        self.hosts.check_routes(self)
        if not self.alive:
            raise HostsError(f"{self.name} is down (killed): revive() it first")

    def run(self, cmd: Sequence[str], *, hide: Sequence[str | Path] = (), **popen) -> subprocess.Popen:
        """Start `cmd` in this host, in a session of its own; in a mount namespace of its own, an empty
        read-only tmpfs covers each directory of `hide` (/dev/null each file) for this process alone."""
        self._check()
        argv = ["ip", "netns", "exec", self.name]
        if hide:
            paths = [str(p) for p in hide]
            if missing := [p for p in paths if not os.path.isabs(p) or not os.path.exists(p)]:
                raise HostsError(f"cannot hide {missing}: not absolute paths that exist")
            argv += [*_UNSHARE, *paths, "--"]
        popen.setdefault("start_new_session", True)
        proc = subprocess.Popen([*argv, *cmd], **popen)
        self._procs.append(proc)
        return proc

    def check_output(self, cmd: Sequence[str], *, timeout_s: float = 30, hide=(), **popen) -> str:
        """`cmd`'s stdout; CalledProcessError if it fails, TimeoutExpired (group killed) past timeout_s."""
        proc = self.run(cmd, hide=hide, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        finally:
            if proc.poll() is None:  # past timeout_s
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
        if proc.returncode:
            raise subprocess.CalledProcessError(proc.returncode, list(cmd), out, err)
        return out

    def url(self, port: int, path: str = "") -> str:
        self._check()
        return f"http://{self.address}:{port}{path}"

    def answers(self, port: int, timeout_s: float = 1.0) -> bool:
        """Whether a TCP connection to `port` opens from the root namespace, through the bridge, within
        `timeout_s`. Allowed on a killed host (to see that it no longer answers), never on a harness down."""
        self.hosts.check_routes(self)
        try:
            socket.create_connection((self.address, port), timeout=timeout_s).close()
            return True
        except OSError:
            return False

    def wait_port(self, port: int, timeout_s: float = 30, proc: subprocess.Popen | None = None) -> None:
        """Wait until `port` answers through the bridge; raise if `proc` exits first or time runs out."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._check()
            with contextlib.suppress(OSError):
                socket.create_connection((self.address, port), timeout=0.5).close()
                return
            if proc is not None and proc.poll() is not None:
                raise HostsError(f"{self.name}: the server exited ({proc.returncode}) before {port} answered")
            if time.monotonic() > deadline:
                raise HostsError(f"{self.name}: port {port} did not answer within {timeout_s:g} s")
            time.sleep(0.05)

    def serve(self, cmd: Sequence[str], port: int, *, timeout_s: float = 30, **run) -> subprocess.Popen:
        """Start a server (on the host's address, or 0.0.0.0: the host has lo and eth0 alone); return it once
        `port` answers through the bridge, else kill its group and raise with its output."""
        with tempfile.TemporaryFile() as log:  # the server keeps its own descriptor
            if "stdout" not in run:
                run.update(stdout=log, stderr=subprocess.STDOUT)
            proc = self.run(cmd, **run)
            try:
                self.wait_port(port, timeout_s, proc)
            except HostsError as e:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                log.seek(0)
                raise HostsError(f"{e}\n{log.read()[-2000:].decode(errors='replace')}") from None
        return proc

    def kill(self) -> None:
        """Die like a machine: SIGKILL every process in the namespace, then take eth0 down, so that the
        address neither answers nor refuses (connections time out) until `revive`."""
        self.hosts.check_routes()
        self.alive = False
        _kill_ns(self.name)
        self._reap()
        _ip("link", "set", "eth0", "down", ns=self.name)

    def revive(self) -> None:
        """Bring a killed host back, same address, no process running."""
        self.hosts.check_routes()
        _ip("link", "set", "eth0", "up", ns=self.name)
        self.alive = True
        self.hosts.check_routes(self)


class Hosts:
    """`n` hosts on a bridge (see the module's docstring); a context manager, or `start` / `stop`."""

    def __init__(self, n: int, *, prefix: str = "gf"):
        if not re.fullmatch(r"[a-z]{1,4}", prefix) or not 1 <= n <= 99:
            raise ValueError("prefix: 1 to 4 lowercase letters (names stay within 15 chars); n: 1 to 99")
        self.prefix, self.id = prefix, secrets.token_hex(3)
        self.bridge = f"{prefix}br{self.id}"
        self.marker = RUN_DIR / f"{prefix}{self.id}.json"
        self.subnet: ipaddress.IPv4Network | None = None
        self.up = False
        self.hosts = [Host(self, i) for i in range(n)]

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __enter__(self) -> Hosts:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def names(self) -> list[str]:
        """Every namespace and link this harness makes."""
        return [self.bridge] + [n for h in self.hosts for n in (h.name, h.veth)]

    def start(self) -> None:
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        with open(RUN_DIR / "lock", "w") as lock:  # one session at a time picks a subnet and cleans
            fcntl.flock(lock, fcntl.LOCK_EX)
            clean_leftovers(self.prefix)
            pid = os.getpid()
            self.marker.write_text(json.dumps({"pid": pid, "start": _start_time(pid)}))  # before any name
            _LIVE.add(self)
            _install_handlers()
            try:
                self.subnet = _free_subnet()
                self._build()
                self.up = True
                for host in self.hosts:
                    host.alive = True
                    self.check_routes(host)
            except BaseException:
                self.stop()
                raise

    def _build(self) -> None:
        net = list(self.subnet.hosts())  # 10.R.S.1 ...
        _ip("link", "add", self.bridge, "type", "bridge")
        _sysctl(f"ipv6/conf/{self.bridge}/disable_ipv6", "1")
        _sysctl(f"ipv4/conf/{self.bridge}/forwarding", "0")
        _ip("addr", "add", f"{net[0]}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for host in self.hosts:
            host.address = str(net[9 + host.index])  # 10.R.S.(10 + i)
            _ip("netns", "add", host.name)
            no_ipv6 = ["net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"]
            _ip("netns", "exec", host.name, "sysctl", "-qw", *no_ipv6, check=False)  # fails: no IPv6 at all
            _ip("link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.name)
            _sysctl(f"ipv6/conf/{host.veth}/disable_ipv6", "1")
            _ip("link", "set", host.veth, "master", self.bridge, "up")
            _ip("addr", "add", f"{host.address}/24", "dev", "eth0", ns=host.name)
            _ip("link", "set", "eth0", "up", ns=host.name)
            _ip("link", "set", "lo", "up", ns=host.name)

    def check_routes(self, host: Host | None = None) -> None:
        """Refuse unless the harness is up, the bridge forwards nothing and, for `host`, its address is
        routed through the bridge and its own table holds the subnet's link route alone."""
        if not self.up:
            raise HostsError("the hosts are down (not started, or stopped): nothing goes to the subnet")
        if Path(f"/proc/sys/net/ipv4/conf/{self.bridge}/forwarding").read_text().strip() != "0":
            raise HostsError(f"{self.bridge} forwards packets off the bridge (its IPv4 forwarding is on)")
        if host is None:
            return
        try:
            routes = [r.get("dev") for r in _ip_json("route", "get", host.address)]
        except HostsError as e:  # e.g. a blackhole or unreachable route
            routes = [str(e)]
        if routes != [self.bridge]:
            raise HostsError(f"{host.address} is not routed through {self.bridge}: {routes}")
        own = [(r.get("dst"), r.get("dev"), r.get("scope")) for r in _ip_json("route", ns=host.name)]
        if own != [(str(self.subnet), "eth0", "link")] and host.alive:
            raise HostsError(f"{host.name}'s routes are not the subnet's link route alone: {own}")

    def stop(self) -> None:
        """Kill the hosts' processes, delete namespaces, veths, bridge; idempotent; raise if any is left."""
        self.up = False
        errors = []
        links = [h.veth for h in self.hosts] + [self.bridge]
        for kind, name in [("netns", h.name) for h in self.hosts] + [("link", n) for n in links]:
            try:
                _remove(kind, name)
            except (HostsError, subprocess.SubprocessError, OSError) as e:  # the rest still go
                errors.append(str(e))
        for host in self.hosts:
            host.alive = False
            host._reap()
        if left := sorted(set(self.names()) & present()):
            raise HostsError(f"teardown left {left}: {errors}")
        self.marker.unlink(missing_ok=True)
        _LIVE.discard(self)


def ray_node(host: Host, temp: str | Path, *args: str) -> list[str]:
    """The command that runs a Ray node on `host` until it is killed (`ray start --block`, the `ray` next
    to this Python): at the host's address, its sessions and sockets under `temp` (keep it short: a
    socket path has at most 107 bytes), a 100 MB object store; a head (`--head` in `args`) has no
    dashboard. Run it with RAY_USAGE_STATS_ENABLED=0 in its environment."""
    head = ["--include-dashboard=false", "--disable-usage-stats"] if "--head" in args else []
    return [str(Path(sys.executable).with_name("ray")), "start", "--block", f"--node-ip-address={host.address}",
            f"--temp-dir={temp}", "--object-store-memory=100000000", *head, *args]  # fmt: skip
