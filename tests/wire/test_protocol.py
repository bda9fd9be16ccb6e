"""The wire format (kvstore.wire.protocol), the socket path rule and the peer-uid check,
in-process."""

from __future__ import annotations

import os
import socket
import struct
import time
import tracemalloc
from pathlib import Path

import msgpack
import pytest

from kvstore.daemon.lifecycle import UCRED, XUCRED, peer_allowed, peer_uid
from kvstore.errors import DaemonError, KVStoreError, ProtocolError
from kvstore.home.ledger import validate
from kvstore.home.settings import SOCKET_NAME
from kvstore.wire import daemon_client, protocol


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield a, b
    a.close()
    b.close()


def test_round_trip_keeps_bytes_and_nesting(pair):
    a, b = pair
    msg = {"cmd": "put", "args": {"key": b"\x00" * 32, "n": 2**40, "xs": [1.5, None, "é"]}}
    protocol.send(a, msg)
    protocol.send(a, {"cmd": "ping"})
    assert protocol.recv(b, timeout=1) == msg
    assert protocol.recv(b, timeout=1) == {"cmd": "ping"}


def test_clean_close_between_frames_is_none(pair):
    a, b = pair
    a.close()
    assert protocol.recv(b, timeout=1) is None


@pytest.mark.parametrize(
    "raw, match",
    [
        (protocol.HEADER.pack(0), "empty frame"),
        (protocol.HEADER.pack(5) + b"\xc1\xc1\xc1\xc1\xc1", "not msgpack"),
        (protocol.HEADER.pack(3) + msgpack.packb([1, 2]), "expected a map"),
        (protocol.HEADER.pack(1) + msgpack.packb(7), "expected a map"),
        (protocol.HEADER.pack(2) + b"\x80\x80", "not msgpack"),  # a map, then trailing bytes
    ],
)
def test_bad_payloads_raise_protocol_error(pair, raw, match):
    a, b = pair
    a.sendall(raw)
    with pytest.raises(ProtocolError, match=match):
        protocol.recv(b, timeout=1)


def test_claimed_length_over_the_cap_is_refused_before_allocating(pair):
    a, b = pair
    a.sendall(protocol.HEADER.pack(2**32 - 1))
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match="over the cap"):
            protocol.recv(b, timeout=1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20  # nothing near the 4 GiB claimed


def test_cap_is_the_callers(pair):
    a, b = pair
    protocol.send(a, {"blob": b"x" * 1000})
    with pytest.raises(ProtocolError, match="over the cap of 100"):
        protocol.recv(b, max_bytes=100, timeout=1)
    with pytest.raises(ProtocolError, match="over the cap"):
        protocol.pack({"blob": b"x" * 1000}, max_bytes=100)


@pytest.mark.parametrize("cut", [2, protocol.HEADER.size + 3])
def test_truncated_frames_raise(pair, cut):
    a, b = pair
    a.sendall(protocol.pack({"cmd": "ping", "args": {"pad": "x" * 20}})[:cut])
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(ProtocolError, match="closed inside"):
        protocol.recv(b, timeout=1)


def test_silence_times_out(pair):
    _, b = pair
    t = time.monotonic()
    with pytest.raises(ProtocolError, match="timed out"):
        protocol.recv(b, timeout=0.2)
    assert time.monotonic() - t < 1


def test_a_trickled_frame_is_bounded_by_the_frame_timeout(pair):
    a, b = pair
    a.sendall(protocol.pack({"cmd": "ping"})[:3])  # starts a frame, never finishes it
    t = time.monotonic()
    with pytest.raises(ProtocolError, match="timed out reading the frame header"):
        protocol.recv(b, timeout=10, frame_timeout=0.2)
    assert time.monotonic() - t < 1


# -- socket path ---------------------------------------------------------------------------


def test_short_home_uses_the_socket_in_the_home(tmp_path):
    assert daemon_client.socket_path(tmp_path) == tmp_path.absolute() / SOCKET_NAME


def test_long_home_gets_a_short_private_fallback(tmp_path, monkeypatch):
    root = tmp_path / "r"
    root.mkdir()
    monkeypatch.setattr(daemon_client, "FALLBACK_ROOT", root)
    home = tmp_path / ("deep" * 40)
    path = daemon_client.socket_path(home, create=True)
    assert len(os.fsencode(str(path))) < daemon_client.SUN_PATH_MAX
    assert path.parent == root / f"kvstore-{os.getuid()}"
    assert path.parent.stat().st_mode & 0o777 == 0o700
    # both ends compute it alike, and another home gets another path
    assert daemon_client.socket_path(home) == path
    assert daemon_client.socket_path(tmp_path / ("other" * 40)) != path


def test_fallback_dir_open_to_others_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "r"
    root.mkdir()
    monkeypatch.setattr(daemon_client, "FALLBACK_ROOT", root)
    (root / f"kvstore-{os.getuid()}").mkdir(mode=0o777)
    os.chmod(root / f"kvstore-{os.getuid()}", 0o777)
    with pytest.raises(KVStoreError, match="not a private directory"):
        daemon_client.socket_path(tmp_path / ("deep" * 40))


def test_connect_is_none_without_a_daemon(tmp_path):
    assert daemon_client.connect(tmp_path) is None
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(tmp_path / SOCKET_NAME))  # a stale socket file: nobody listens
    srv.close()
    assert (tmp_path / SOCKET_NAME).exists()
    assert daemon_client.connect(tmp_path) is None


# -- peer credentials ----------------------------------------------------------------------


def test_peer_uid_reads_linux_ucred():
    raw = UCRED.pack(4242, 501, 20)
    assert peer_uid(raw, "ucred") == 501
    assert peer_allowed(raw, "ucred", 501)
    assert not peer_allowed(raw, "ucred", 0)
    assert not peer_allowed(raw[:8], "ucred", 501)  # short: refused, not guessed


def test_peer_uid_reads_macos_xucred():
    raw = XUCRED.pack(0, 501, 3, 20, 12, 61, *([0] * 13))
    assert len(raw) == 76  # sizeof(struct xucred) on macOS
    assert peer_uid(raw, "xucred") == 501
    assert peer_allowed(raw, "xucred", 501)
    assert not peer_allowed(raw, "xucred", 502)
    assert not peer_allowed(struct.pack("=II", 1, 501), "xucred", 501)  # unknown version
    assert not peer_allowed(raw, "nonesuch", 501)


def test_peer_uid_of_a_real_socketpair_is_ours(pair):
    if not hasattr(socket, "SO_PEERCRED"):
        pytest.skip("SO_PEERCRED is Linux's")
    raw = pair[0].getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, UCRED.size)
    assert peer_uid(raw, "ucred") == os.getuid()


# -- ledger records ------------------------------------------------------------------------


def test_ledger_batches_are_validated():
    good = dict(
        model="m",
        label="l",
        prompt_tokens=10,
        cached_tokens=8,
        prefilled_tokens=2,
        prefill_s=0.1,
        decode_s=1,
    )
    assert validate([good]) == [good]
    # known optional fields are kept, unknown ones dropped
    assert validate([{**good, "generated_tokens": 3, "junk": "x"}]) == [
        {**good, "generated_tokens": 3}
    ]
    with pytest.raises(ValueError, match="prompt_tokens"):
        validate([{**good, "prompt_tokens": "10"}])
    with pytest.raises(ValueError, match="list"):
        validate(good)


def test_path_helpers_do_not_touch_the_fallback_root_for_short_homes(tmp_path, monkeypatch):
    monkeypatch.setattr(daemon_client, "FALLBACK_ROOT", Path("/nonexistent-root"))
    assert daemon_client.socket_path(tmp_path, create=True).parent == tmp_path.absolute()


def test_ledger_append_survives_short_writes(tmp_path, monkeypatch):
    from kvstore.home import ledger as ledger_mod

    calls = []

    class ShortWrites:  # the ledger's `os`, whose write may write less than asked
        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def write(fd, data):
            calls.append(len(data))
            return os.write(fd, bytes(data[:7]))

    rec = dict(model="m", label="l", prompt_tokens=10, cached_tokens=8, prefilled_tokens=2,
               prefill_s=0.1, decode_s=1.5)  # fmt: skip
    monkeypatch.setattr(ledger_mod, "os", ShortWrites())
    led = ledger_mod.Ledger(tmp_path)
    assert led.append([rec, {**rec, "label": "k"}]) == 2
    monkeypatch.undo()
    assert len(calls) > 2
    again = ledger_mod.Ledger(tmp_path)  # every record reads back whole
    assert again.records == 2
    assert [r["label"] for r in again.stats()["by_model_label"]] == ["k", "l"]


def test_connect_raises_when_a_daemon_refuses_but_is_none_when_it_goes_away(tmp_path):
    import threading

    from kvstore.wire.codes import ErrorCode

    home = tmp_path / "h"
    home.mkdir()
    path = daemon_client.socket_path(home)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen(4)
    said = [protocol.error("too many connections (max_connections=1)", ErrorCode.BUSY), None]

    def serve():
        for reply in said:
            conn, _ = listener.accept()
            if reply is not None:  # what the daemon does at its cap: say why, hang up
                protocol.send(conn, reply)
            conn.close()  # None: a daemon stopping closes without a word

    t = threading.Thread(target=serve)
    t.start()
    try:
        with pytest.raises(DaemonError, match=r"daemon at .* is busy \(too many connections\)"):
            daemon_client.connect(home)
        assert daemon_client.connect(home) is None
    finally:
        t.join(10)
        listener.close()
