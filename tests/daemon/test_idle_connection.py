"""A client connection that stays idle past idle_timeout is normal operation: the daemon closes
it (telling the client why, as before) and logs it below warning."""

from __future__ import annotations

import socket

from helpers import Proc, wait_for

from kvstore.home.settings import SOCKET_NAME
from kvstore.wire import protocol


def test_an_idle_connection_is_closed_without_a_warning(tmp_path):
    home = tmp_path / "h"
    home.mkdir(mode=0o700)
    (home / "settings.toml").write_text("idle_timeout = 0.5\n")
    d = Proc(home, "--log-level", "debug", log=tmp_path / "d.log")
    try:
        d.wait_ready()
        for _ in range(3):  # an app between calls: one request, then silence
            with socket.socket(socket.AF_UNIX) as sock:
                sock.connect(str(home / SOCKET_NAME))
                protocol.send(sock, {"cmd": "ping"})
                assert protocol.recv(sock, timeout=30)["ok"]
                reply = protocol.recv(sock, timeout=30)  # why it hangs up, then EOF
                assert reply is not None and "timed out" in reply["error"], reply
                assert protocol.recv(sock, timeout=30) is None
        # logged either way (the debug line, or the warning it was before): then judged
        wait_for(lambda: d.text().count("(idle_timeout)") + d.text().count("timed out") >= 3,
                 what=d.text)  # fmt: skip
        warnings = [ln for ln in d.text().splitlines() if " WARNING " in ln]
        assert not any("timed out" in ln or "connection closed" in ln for ln in warnings), warnings
        idle = [ln for ln in d.text().splitlines() if "(idle_timeout)" in ln]
        assert len(idle) == 3 and all(" DEBUG " in ln for ln in idle), idle
        assert d.request("ping")  # and it still serves
    finally:
        rc, _ = d.stop()
    assert rc == 0, d.text()
