"""Streamed puts hold what arrived, not what was claimed (issue 10 item 12): clients that claim a
large blob, send 1 MiB and then stall or hang up must not make a real daemon's memory jump."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import battery
from helpers import Proc, serving

from kvstore.store.entry import entry_key, pack_tokens
from kvstore.wire import protocol
from kvstore.wire.daemon_client import socket_path

MiB, GiB = 2**20, 2**30
CLAIMED = 1 * GiB  # per connection; the daemon allows up to max_bytes (8 GiB by default)
CONNECTIONS = 3
SENT = 1 * MiB


def _status(pid: int, field: str) -> int:
    """A /proc/PID/status memory figure in bytes (VmRSS now, VmHWM the peak so far)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"{field} not in /proc/{pid}/status")


def _claim_and_stall(home: Path, i: int) -> socket.socket:
    tokens = [9000 + i, 1]
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(str(socket_path(home)))
    args = {
        "key": entry_key(b"\x5a" * 16, tokens),
        "fields": {"tokens": pack_tokens(tokens), "label": f"claims-{i}"},
        "nbytes": CLAIMED,
        "checksum": 0,
    }
    protocol.send(s, {"cmd": "put", "args": args})
    protocol.send(s, {"data": bytes(SENT)})  # returns once the daemon has read most of it
    return s


def test_a_stalled_streamed_put_costs_what_arrived_not_what_was_claimed(tmp_path):
    home = tmp_path / "home"
    d = Proc(home, log=tmp_path / "daemon.log")
    with serving(d, warm=False):
        peak_before = _status(d.pid, "VmHWM")
        socks = [_claim_and_stall(home, i) for i in range(CONNECTIONS)]
        time.sleep(0.5)  # stalled: the daemon waits for the rest of each blob
        held = _status(d.pid, "VmRSS")
        assert d.request("ping")["pid"] == d.pid  # still serving beside the stalled puts
        for s in socks:
            s.close()
        for _ in range(CONNECTIONS):
            d.wait_log(f"connection closed after {SENT} of {CLAIMED} streamed bytes")
        growth = _status(d.pid, "VmHWM") - peak_before
        battery.record(
            "stalled_streamed_puts",
            connections=CONNECTIONS,
            claimed_mib_each=CLAIMED // MiB,
            sent_mib_each=SENT // MiB,
            daemon_peak_rss_growth_mib=round(growth / MiB, 1),
            daemon_rss_while_stalled_mib=round(held / MiB, 1),
        )
        # Before the fix each claim was a zeroed bytearray(nbytes): 3 GiB resident at once.
        assert growth < 64 * MiB, f"daemon peak RSS grew {growth / MiB:.0f} MiB"
        assert d.request("ls") == []  # nothing half-received was stored
