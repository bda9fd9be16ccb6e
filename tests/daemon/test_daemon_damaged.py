"""A store file damaged under a running daemon (issue 43 item 3): zeroed meta pages, random
bytes, overwritten data pages, a truncation. The first request that meets it is answered with the
line a fresh start on that file says (never an internal error, never a "disk full"), and the
daemon logs that line once, removes its socket and exits store_damaged (78), as a restart would.
A daemon that died on such a file anyway (a SIGBUS) leaves a socket its next start removes."""

from __future__ import annotations

import random
import signal
from pathlib import Path

import pytest
from helpers import TWO_PINS, Proc, manifest_for, warm_two_pins

from kvstore.daemon import exits
from kvstore.errors import DaemonError
from kvstore.store.store import Store
from kvstore.wire.daemon_client import socket_path

pytestmark = pytest.mark.slow

DAMAGED = "the store file is damaged"
HINT = "restore it from a backup, or move it aside"
PAGE = 4096


def _zero_meta(data: Path) -> None:
    with data.open("r+b") as f:
        f.write(b"\0" * 2 * PAGE)


def _random_bytes(data: Path) -> None:
    size = data.stat().st_size
    data.write_bytes(random.Random(43).randbytes(size))  # in place: the same inode


def _overwrite_pages(data: Path) -> None:
    rng = random.Random(3)
    with data.open("r+b") as f:
        for page in range(2, data.stat().st_size // PAGE):
            f.seek(page * PAGE)
            f.write(rng.randbytes(PAGE))


def _truncate(data: Path) -> None:
    with data.open("r+b") as f:
        f.truncate(3 * PAGE)


def _home_with_entries(tmp_path: Path, llama_path: Path) -> tuple[Path, Path]:
    home = tmp_path / "home"
    warm_two_pins(tmp_path, home, llama_path)
    with Store(home, readonly=True) as store:
        assert store.stats()["file_bytes"] > 8 * PAGE  # pages past the cut and the overwrites
    return home, manifest_for(tmp_path, llama_path, TWO_PINS)


@pytest.mark.parametrize(
    ("damage", "first"),
    [
        (_zero_meta, "stats"),
        (_random_bytes, "warm"),
        (_overwrite_pages, "repair"),
        (_truncate, "stats"),
        (_overwrite_pages, "reconcile"),
    ],
    ids=["zeroed-meta-pages", "random-bytes", "overwritten-pages", "truncated", "reconcile"],
)
def test_damage_under_a_running_daemon_is_one_line_and_exit_78(tmp_path, llama_path, damage, first):
    """`reconcile`: a warm of every manifest the daemon watches (`kvstore warm` with none)."""
    home, manifest = _home_with_entries(tmp_path, llama_path)
    started = ("--manifest", str(manifest)) if first == "reconcile" else ()
    d = Proc(home, *started, log=tmp_path / "d.log")
    try:
        d.wait_ready()
        if started:
            d.wait_warm()
        assert d.request("stats")["entries"] == 2
        damage(home / "store" / "data.mdb")
        args = {"manifest": str(manifest)} if first == "warm" else {}
        try:
            said = str(d.request("warm" if first == "reconcile" else first, **args))
        except DaemonError as e:
            said = str(e)
        assert DAMAGED in said and HINT in said, said
        assert "internal error" not in said and "disk full" not in said, said
        rc = d.p.wait(timeout=30)
    finally:
        if d.p.poll() is None:
            d.p.kill()
            d.p.wait()
    log = d.text()
    assert rc == exits.EXITS["store_damaged"].code, log
    assert "Traceback" not in log and "internal error" not in log and "disk full" not in log, log
    lines = [ln for ln in log.splitlines() if DAMAGED in ln]
    assert len(lines) == 1 and " ERROR " in lines[0] and HINT in lines[0], log
    assert not socket_path(home).exists(), log
    assert (home / "store" / "data.mdb").exists()  # kept, not replaced


def test_a_start_after_a_death_on_a_truncated_file_removes_its_socket(tmp_path, llama_path):
    """A daemon killed by a signal leaves its socket; the next start refuses the truncated file
    in one line and removes that socket, so clients see no daemon rather than a dead one."""
    home, _ = _home_with_entries(tmp_path, llama_path)
    first = Proc(home, log=tmp_path / "first.log")
    first.wait_ready()
    first.stop(signal.SIGKILL)  # as a SIGBUS would: no shutdown, the socket left behind
    assert socket_path(home).exists()
    _truncate(home / "store" / "data.mdb")
    d = Proc(home, log=tmp_path / "d.log")
    rc = d.p.wait(timeout=60)
    log = d.text()
    assert rc == exits.EXITS["store_damaged"].code, log
    assert DAMAGED in log and "Traceback" not in log, log
    assert not socket_path(home).exists(), log


def test_under_launchd_a_damaged_store_parks_the_daemon_without_its_socket(
    tmp_path, llama_path, monkeypatch
):
    """launchd restarts every non-zero exit: there the daemon says the line, removes its socket
    and waits for SIGTERM (daemon/exits.py), then exits 78."""
    monkeypatch.setenv(exits.SUPERVISOR_ENV, "launchd")
    home, _ = _home_with_entries(tmp_path, llama_path)
    d = Proc(home, log=tmp_path / "d.log")
    try:
        d.wait_ready()
        _zero_meta(home / "store" / "data.mdb")
        with pytest.raises(DaemonError, match=DAMAGED):
            d.request("stats")
        d.wait_log("waits here until stopped")
        assert d.p.poll() is None and not socket_path(home).exists(), d.text()
    finally:
        rc, _ = d.stop()
    assert rc == exits.EXITS["store_damaged"].code, d.text()
    assert "Traceback" not in d.text(), d.text()
