"""The daemon's log under launchd: rotated by the daemon itself, launchd's file kept for crashes."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

from helpers import Proc

from kvstore.daemon import logs


def test_log_file_rotates_at_its_cap(tmp_path, monkeypatch):
    monkeypatch.setattr(logs, "LOG_BYTES", 2000)
    path = tmp_path / "logs" / "daemon.log"
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        logs.setup_logging("info", path)
        for i in range(400):
            logging.getLogger("kvstore.daemon").info("line %d %s", i, "x" * 40)
    finally:
        for h in root.handlers:
            h.close()
        root.handlers[:], root.level = saved
    files = sorted(p.name for p in path.parent.iterdir())
    assert files == ["daemon.log", "daemon.log.1", "daemon.log.2", "daemon.log.3"]
    assert all((path.parent / f).stat().st_size <= 2000 for f in files)
    assert "line 399" in path.read_text()  # the newest lines are in daemon.log


def test_crash_log_over_its_cap_is_moved_aside_at_start(tmp_path):
    crash = tmp_path / "daemon.stderr.log"
    crash.write_text("old traceback\n" * 200)
    # As launchd does: stdout and stderr opened O_APPEND on the file before the daemon starts.
    code = textwrap.dedent(f"""
        import os, sys
        from pathlib import Path
        fd = os.open({str(crash)!r}, os.O_WRONLY | os.O_APPEND)
        os.dup2(fd, 1); os.dup2(fd, 2)
        from kvstore.daemon.logs import cap_crash_log
        assert cap_crash_log(Path({str(crash)!r}), cap=1000)
        print("new crash", file=sys.stderr, flush=True)
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert crash.read_text() == "new crash\n"
    assert crash.with_name("daemon.stderr.log.1").read_text().startswith("old traceback")


def test_crash_log_under_its_cap_is_left_alone(tmp_path):
    crash = tmp_path / "daemon.stderr.log"
    crash.write_text("small\n")
    assert not logs.cap_crash_log(crash, cap=1000)
    assert crash.read_text() == "small\n"


def test_daemon_with_log_file_logs_there_not_to_stderr(tmp_path):
    log = tmp_path / "logs" / "daemon.log"
    d = Proc(tmp_path / "h", "--log-file", str(log), log=tmp_path / "stderr.log")
    try:
        d.wait_ready()
    finally:
        rc, _ = d.stop()
    assert rc == 0
    assert "serving" in log.read_text() and "stopped" in log.read_text()
    assert d.text() == ""  # launchd's StandardErrorPath gets crashes only
