"""Exit status per condition (daemon/exits.py), with real daemon processes."""

from __future__ import annotations

import signal
import time

import pytest
from helpers import TWO_PINS, Proc, manifest_for, wait_for

from kvstore.daemon import exits

pytestmark = pytest.mark.slow

_PATCHED = """
import sys
{patch}
from kvstore.cli.main import main
main(["daemon", *sys.argv[1:]])
"""

_ACCEPT_FAILS = """
from kvstore.daemon.server import Daemon
def broken_accept(self):
    raise RuntimeError("injected: accept loop bug")
Daemon._accept = broken_accept
"""

_BIND_REFUSED = """
import socket
def refused(self, address):
    raise PermissionError(1, "Operation not permitted")
socket.socket.bind = refused
"""


# A full disk or a failing disk at start, injected on the real calls: lmdb.open (py-lmdb raises
# DiskError for ENOSPC, a plain Error ending in the OS's text for EIO) and the store's mkdir.
_LMDB_OPEN_FAILS = """
import lmdb
def full(path, **kw):
    raise lmdb.{cls}(path + ": {text}")
lmdb.open = full
"""

_STORE_MKDIR_EIO = """
import errno, os, pathlib
real = pathlib.Path.mkdir
def failing(self, *a, **kw):
    if self.name == "store":
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(self))
    return real(self, *a, **kw)
pathlib.Path.mkdir = failing
"""


def _exit_code(d: Proc, timeout: float = 60) -> int:
    return d.p.wait(timeout=timeout)


def test_lock_held_by_another_daemon_exits_0_with_one_line(tmp_path):
    home = tmp_path / "h"
    first = Proc(home, log=tmp_path / "1.log")
    try:
        first.wait_ready()
        second = Proc(home, log=tmp_path / "2.log")
        assert _exit_code(second) == exits.LOCK_HELD == 0
        lines = [ln for ln in second.text().splitlines() if "already runs" in ln]
        assert len(lines) == 1 and f"pid {first.pid}" in lines[0]
        assert "exits 0" in lines[0]
        assert first.request("ping")["pid"] == first.pid
    finally:
        assert first.stop()[0] == 0


def test_internal_failure_of_the_accept_loop_exits_non_zero(tmp_path):
    from kvstore.wire.daemon_client import connect

    d = Proc(tmp_path / "h", log=tmp_path / "d.log", code=_PATCHED.format(patch=_ACCEPT_FAILS))
    wait_for(lambda: "serving" in d.text(), what=d.text, proc=d.p)
    connect(d.home, timeout=2)  # accepting it raises inside the accept loop
    code = _exit_code(d)
    assert code == exits.INTERNAL, d.text()
    assert exits.restarted_by_launchd(code) and exits.restarted_by_systemd(code)
    assert "accept loop failed" in d.text() and "injected: accept loop bug" in d.text()


def test_socket_refused_exits_config_at_once_by_hand(tmp_path):
    d = Proc(tmp_path / "h", log=tmp_path / "d.log", code=_PATCHED.format(patch=_BIND_REFUSED))
    code = _exit_code(d)
    assert code == exits.CONFIG, d.text()
    assert not exits.restarted_by_systemd(code)  # RestartPreventExitStatus
    errors = [ln for ln in d.text().splitlines() if " ERROR " in ln]
    assert len(errors) == 1 and "Operation not permitted" in errors[0], d.text()


def test_socket_refused_under_launchd_waits_instead_of_being_restarted(tmp_path, monkeypatch):
    # launchd restarts every non-zero exit, every ThrottleInterval: the daemon parks instead.
    monkeypatch.setenv(exits.SUPERVISOR_ENV, "launchd")
    d = Proc(tmp_path / "h", log=tmp_path / "d.log", code=_PATCHED.format(patch=_BIND_REFUSED))
    d.wait_log("waits here until stopped")
    time.sleep(1.0)
    assert d.p.poll() is None, d.text()
    assert d.text().count("waits here until stopped") == 1
    rc, seconds = d.stop(signal.SIGTERM)
    assert rc == exits.CONFIG and seconds < 5, d.text()


def test_missing_manifest_waits_for_it_says_so_once_then_warms(tmp_path, llama_path):
    manifest = tmp_path / "later" / "pins.toml"
    d = Proc(tmp_path / "h", "--manifest", str(manifest), log=tmp_path / "d.log")
    try:
        d.wait_ready()  # serving, not exited
        time.sleep(1.0)
        assert d.text().count("manifest file not found") == 1, d.text()
        assert d.request("stats")["daemon"]["last_warm"] is None
        manifest.parent.mkdir()
        manifest_for(manifest.parent, llama_path, TWO_PINS, name="pins.toml")
        w = d.wait_warm()
        assert w["warmed"] == 2 and w["manifest"] == str(manifest), d.text()
        assert d.text().count("manifest file not found") == 1
    finally:
        rc, _ = d.stop()
    assert rc == 0, d.text()


@pytest.mark.parametrize(
    "patch",
    [
        _LMDB_OPEN_FAILS.format(cls="DiskError", text="No space left on device"),
        _LMDB_OPEN_FAILS.format(cls="Error", text="Input/output error"),
        _STORE_MKDIR_EIO,
    ],
    ids=["enospc-at-lmdb-open", "eio-at-lmdb-open", "eio-at-store-mkdir"],
)
def test_a_transient_io_error_at_start_exits_restartable_naming_the_path(
    tmp_path, monkeypatch, patch
):
    # Started by hand (under a supervisor it waits and tries again: test_daemon_disk_full.py).
    monkeypatch.delenv(exits.SUPERVISOR_ENV, raising=False)
    home = tmp_path / "h"
    d = Proc(home, log=tmp_path / "d.log", code=_PATCHED.format(patch=patch))
    code = _exit_code(d)
    assert code == exits.TRANSIENT_IO == 70, d.text()
    assert exits.restarted_by_systemd(code) and exits.restarted_by_launchd(code)
    assert code not in exits.restart_prevent_statuses()
    errors = [ln for ln in d.text().splitlines() if " ERROR " in ln]
    assert len(errors) == 1, d.text()
    assert str(home / "store") in errors[0], errors[0]
    assert "No space left on device" in errors[0] or "Input/output error" in errors[0]
    assert "waits here until stopped" not in d.text()
