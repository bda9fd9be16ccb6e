"""The daemon on a full disk (issue 34 item 5): a ledger write it cannot make is one line to the
client and in its log, never a traceback or an internal error; a transient I/O error at start,
under a supervisor, is waited out with backoff inside (daemon/boot.py) instead of an exit that
launchd or systemd would answer with a restart every few seconds."""

from __future__ import annotations

import signal
import time

import pytest
from full_disk import mounted_tmpfs
from helpers import Proc

from kvstore.daemon import exits
from kvstore.errors import DaemonError

pytestmark = pytest.mark.slow

RECORD = {"model": "m", "label": "l", "prompt_tokens": 100, "cached_tokens": 90,
          "prefilled_tokens": 10, "prefill_s": 0.5, "decode_s": 0.25}  # fmt: skip

# lmdb.open fails as py-lmdb fails on a full disk while the marker file exists.
_FULL_WHILE = """
import os, sys, lmdb
real = lmdb.open
def full(path, **kw):
    if os.path.exists({marker!r}):
        raise lmdb.DiskError(path + ": No space left on device")
    return real(path, **kw)
lmdb.open = full
from kvstore.cli.main import main
main(["daemon", *sys.argv[1:]])
"""


def fill(mnt) -> None:
    import shutil

    with open(mnt / "filler", "wb") as f:
        f.write(b"\0" * shutil.disk_usage(mnt).free)
        f.flush()
    assert shutil.disk_usage(mnt).free == 0


def test_a_daemon_refuses_a_record_on_a_full_disk_in_one_line(tmp_path):
    with mounted_tmpfs(tmp_path / "tmpfs", "16m") as mnt:
        d = Proc(mnt / "home", log=tmp_path / "d.log")
        try:
            d.wait_ready()
            d.request("record", records=[RECORD])  # the ledger file exists
            fill(mnt)
            with pytest.raises(DaemonError) as refused:
                d.request("record", records=[RECORD] * 2000)
            line = str(refused.value)
            assert "ledger.msgpack" in line and "No space left on device" in line, line
            assert "internal error" not in line, line
            assert d.request("ping")["pid"] == d.pid  # it goes on
            (mnt / "filler").unlink()
            assert d.request("record", records=[RECORD]) == {"recorded": 1}
        finally:
            rc, _ = d.stop()
        log = d.text()
        assert "Traceback" not in log, log
        assert [ln for ln in log.splitlines() if "No space left" in ln] == [
            ln for ln in log.splitlines() if "ledger.msgpack" in ln and " WARNING " in ln
        ], log
        assert rc == 0, log


@pytest.mark.parametrize("supervisor", ["systemd", "launchd"])
def test_a_full_disk_at_start_is_waited_out_under_a_supervisor(tmp_path, monkeypatch, supervisor):
    monkeypatch.setenv(exits.SUPERVISOR_ENV, supervisor)
    marker = tmp_path / "disk-full"
    marker.touch()
    home = tmp_path / "h"
    d = Proc(home, log=tmp_path / "d.log", code=_FULL_WHILE.format(marker=str(marker)))
    try:
        d.wait_log("trying again in 2 s")
        d.wait_log("trying again in 4 s", timeout=10)
        assert d.p.poll() is None, d.text()  # not exited for the supervisor to restart
        marker.unlink()  # space freed: the next try starts
        d.wait_ready()
    finally:
        rc, _ = d.stop()
    assert rc == 0, d.text()
    tries = [ln for ln in d.text().splitlines() if " ERROR " in ln]
    assert len(tries) == 2, d.text()  # one line a try, each naming the path and the error
    assert all(str(home / "store") in ln and "No space left on device" in ln for ln in tries)
    assert "Traceback" not in d.text()


def test_stopped_while_waiting_to_start_exits_0_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv(exits.SUPERVISOR_ENV, "systemd")
    marker = tmp_path / "disk-full"
    marker.touch()
    d = Proc(tmp_path / "h", log=tmp_path / "d.log", code=_FULL_WHILE.format(marker=str(marker)))
    d.wait_log("trying again in 2 s")
    time.sleep(0.5)
    rc, seconds = d.stop(signal.SIGTERM)
    assert rc == exits.OK and seconds < 2, d.text()
    assert "stopped while waiting to start" in d.text()
