"""Peers and lifecycle: file modes, other users, slow and lying connections, the connection cap;
SIGTERM with 100 requests in flight, and a second daemon on a busy home."""

from __future__ import annotations

import os
import selectors
import signal
import socket
import statistics
import threading
import time

import battery
import pytest
from helpers import Proc

from kvstore.errors import ProtocolError
from kvstore.store.entry import blob_checksum
from kvstore.store.store import Store
from kvstore.wire import daemon_client, protocol
from kvstore.wire.daemon_client import DaemonClient

HEADER_TIMEOUT = 1.0
CAP = 80


@pytest.fixture(scope="module")
def peer_daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("peers")
    home = root / "home"
    home.mkdir(mode=0o700)
    (home / "settings.toml").write_text(
        f"header_timeout = {HEADER_TIMEOUT}\nidle_timeout = 5.0\nmax_connections = {CAP}\n"
    )
    d = Proc(home, log=root / "daemon.log")
    d.wait_ready()
    yield d
    rc, _ = d.stop()
    assert rc == 0, d.text()[-3000:]


def _raw(home) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    s.connect(str(daemon_client.socket_path(home)))
    return s


def _pings(home, n: int, gap: float = 0.0) -> list[float]:
    out = []
    with DaemonClient(home) as c:
        for _ in range(n):
            t = time.perf_counter()
            c.raw("ping")
            out.append(time.perf_counter() - t)
            if gap:
                time.sleep(gap)
    return out


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to switch to another uid")
def test_modes_and_other_uids_refused_without_a_byte_read(peer_daemon):
    """test_daemon checks one foreign connection; here 20 in a row, the cap unaffected."""
    home, sock = peer_daemon.home, daemon_client.socket_path(peer_daemon.home)
    home_mode, sock_mode = home.stat().st_mode & 0o777, sock.stat().st_mode & 0o777
    assert (home_mode, sock_mode) == (0o700, 0o600)
    attempts = 20
    os.chmod(home, 0o711)  # let the other user reach the socket: the uid check must hold alone
    os.chmod(sock, 0o666)
    try:
        pid = os.fork()
        if pid == 0:  # child: sockets and os._exit only
            refused = 0
            try:
                os.chdir(sock.parent)
                os.setuid(65534)
                for _ in range(attempts):
                    s = socket.socket(socket.AF_UNIX)
                    s.settimeout(5)
                    s.connect(sock.name)
                    try:
                        s.sendall(protocol.pack({"cmd": "ping"}))
                        refused += s.recv(1) == b""  # closed without a word
                    except ConnectionError:
                        refused += 1
                    s.close()
            except OSError:
                os._exit(100)
            os._exit(refused)
        _, status = os.waitpid(pid, 0)
    finally:
        os.chmod(home, home_mode)
        os.chmod(sock, sock_mode)
    refused = os.waitstatus_to_exitcode(status)
    logged = peer_daemon.text().count("refused a connection from another user")
    assert peer_daemon.request("ping")["pid"] == peer_daemon.pid
    battery.record(
        "7_peers_modes_uid",
        home_mode=oct(home_mode),
        socket_mode=oct(sock_mode),
        other_uid_attempts=attempts,
        other_uid_refused=refused,
        refusals_logged=logged,
    )
    assert refused == attempts and logged >= attempts


class SlowPeers(threading.Thread):
    """`n` connections each sending a ping frame one byte a second, reconnecting when dropped;
    records how long each lasted."""

    def __init__(self, home, n: int):
        super().__init__(name="slow-peers")
        self.home, self.n = home, n
        self.frame = protocol.pack({"cmd": "ping"})
        self.stop = threading.Event()
        self.lifetimes: list[float] = []
        self.replied = 0

    def run(self) -> None:
        sel = selectors.DefaultSelector()
        conns: dict[socket.socket, list] = {}

        def open_one() -> None:
            s = _raw(self.home)
            s.sendall(self.frame[:1])
            conns[s] = [time.monotonic(), 1]
            sel.register(s, selectors.EVENT_READ)

        for _ in range(self.n):
            open_one()
        next_tick = time.monotonic() + 1.0
        while not self.stop.is_set():
            for key, _ in sel.select(timeout=max(0.0, min(0.1, next_tick - time.monotonic()))):
                s = key.fileobj
                try:
                    data = s.recv(4096)
                except OSError:
                    data = b""
                if data:
                    self.replied += b'"ok"' not in data and b"\xa2ok\xc3" in data
                sel.unregister(s)
                self.lifetimes.append(time.monotonic() - conns.pop(s)[0])
                s.close()
                if not self.stop.is_set():
                    open_one()
            if time.monotonic() >= next_tick:
                next_tick += 1.0
                for s, state in list(conns.items()):
                    if state[1] < len(self.frame):
                        try:
                            s.send(self.frame[state[1] : state[1] + 1])
                            state[1] += 1
                        except OSError:
                            pass
        for s in conns:
            s.close()
        sel.close()


def test_slow_peers_are_dropped_and_a_normal_client_keeps_its_latency(peer_daemon):
    home = peer_daemon.home
    _pings(home, 50)  # warm up
    quiet = _pings(home, 300, gap=0.005)
    slow = SlowPeers(home, 64)
    slow.start()
    try:
        time.sleep(0.5)
        loaded = _pings(home, 300, gap=0.01)
        time.sleep(max(0.0, 2.5 * HEADER_TIMEOUT + 1.0 - 0.5 - 300 * 0.011))
    finally:
        slow.stop.set()
        slow.join()
    figures = dict(
        slow_connections=64,
        header_timeout_s=HEADER_TIMEOUT,
        slow_dropped=len(slow.lifetimes),
        slow_served=slow.replied,
        slow_lifetime_max_s=round(max(slow.lifetimes), 2),
        ping_p50_ms_quiet=round(1000 * statistics.median(quiet), 3),
        ping_p99_ms_quiet=round(1000 * _pct(quiet, 0.99), 3),
        ping_p50_ms_with_slow_peers=round(1000 * statistics.median(loaded), 3),
        ping_p99_ms_with_slow_peers=round(1000 * _pct(loaded, 0.99), 3),
    )
    battery.record("7_peers_slow", **figures)
    assert len(slow.lifetimes) >= 64 and slow.replied == 0
    # dropped one header_timeout after the first byte, plus the one-second send tick
    assert max(slow.lifetimes) < HEADER_TIMEOUT + 1.5, figures
    assert _pct(loaded, 0.99) < 0.05, figures  # 50 ms on a 2-core box, under load


def test_huge_length_prefixes_allocate_nothing_and_the_cap_holds(peer_daemon):
    home = peer_daemon.home
    time.sleep(HEADER_TIMEOUT + 0.5)  # the previous test's stragglers are gone
    rss0 = peer_daemon.rss()
    replies = []
    for _ in range(64):
        s = _raw(home)
        s.sendall(protocol.HEADER.pack(2**32 - 1) + b"\x80" * 16)  # claims 4 GiB
        try:
            replies.append(protocol.recv(s, timeout=5))
        except ProtocolError:
            replies.append(None)
        s.close()
    growth = peer_daemon.rss() - rss0
    held = [DaemonClient(home) for _ in range(CAP)]
    try:
        for c in held:
            c.raw("ping")
        extra = _raw(home)
        try:
            refusal = protocol.recv(extra, timeout=5)
        except ProtocolError:
            refusal = None
        extra.close()
    finally:
        for c in held:
            c.close()
    time.sleep(0.2)
    assert peer_daemon.request("ping")["pid"] == peer_daemon.pid
    battery.record(
        "7_peers_limits",
        four_gib_prefixes=64,
        refused_with_error=sum(r is not None and r["ok"] is False for r in replies),
        daemon_rss_growth_mib=round(growth / 2**20, 2),
        connection_cap=CAP,
        cap_refusal=(refusal or {}).get("error", "closed"),
    )
    assert all(r is None or "over the cap" in r["error"] for r in replies)
    assert growth < 8 * 2**20, growth
    assert refusal is not None and "too many connections" in refusal["error"]


def test_sigterm_with_100_requests_in_flight(tmp_path):
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    (home / "settings.toml").write_text("max_connections = 128\nidle_timeout = 10.0\n")
    d = Proc(home, log=tmp_path / "daemon.log")
    d.wait_ready()
    second = Proc(home, log=tmp_path / "second.log")  # refused: the first holds the lock
    assert second.p.wait(timeout=60) == 0 and "already runs" in second.text()
    entries = [battery.entry(i, 16_384 + 4096 * (i % 64)) for i in range(100)]
    socks = []
    for key, blob, fields in entries:
        s = _raw(home)
        s.sendall(
            protocol.pack(
                {
                    "cmd": "put",
                    "args": {
                        "key": key,
                        "fields": fields,
                        "nbytes": len(blob),
                        "checksum": blob_checksum(blob),
                        "blob": blob,
                    },
                }  # fmt: skip
            )
        )
        socks.append(s)
    rc, seconds = d.stop(signal.SIGTERM)
    outcomes = {"acknowledged": 0, "refused": 0, "closed": 0}
    acked = []
    for s, (key, _, _) in zip(socks, entries):
        try:
            r = protocol.recv(s, timeout=5)
        except ProtocolError:
            r = None
        s.close()
        if r is None:
            outcomes["closed"] += 1
        elif r["ok"]:
            outcomes["acknowledged"] += 1
            acked.append(key)
        else:
            outcomes["refused"] += 1
    with Store(home, readonly=True) as store:
        problems = store.check()
        missing = [why for k in acked if (why := battery.verify_key(store, k))]
        present = len(store.keys())
    battery.record(
        "8_lifecycle_sigterm",
        in_flight=100,
        exit_code=rc,
        exit_seconds=round(seconds, 2),
        **outcomes,
        present_after=present,
        check_problems=len(problems),
        acknowledged_missing=len(missing),
        second_daemon_refused=True,
    )
    assert rc == 0 and seconds < 5, d.text()[-3000:]
    assert not problems and not missing
    assert present >= len(acked)
