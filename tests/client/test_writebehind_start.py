"""`WriteBehind(start_daemon=True)`, socket activation for one-shot processes (the `llm` plugin):
with no daemon holding the home, one is started, detached, and jobs wait for it instead of being
dropped; once per home and process; nothing is started beside a daemon that holds the home."""

from __future__ import annotations

import os
import signal
import time

from helpers import wait_for

from kvstore.client.writebehind import Job, WriteBehind, spawn_daemon
from kvstore.wire.daemon_client import lock_holder


def _stop(home, pid: int) -> None:
    os.kill(pid, signal.SIGTERM)
    wait_for(lambda: lock_holder(home) is None, 30, "the started daemon to stop")


def test_a_started_daemon_takes_the_jobs_submitted_before_it_answered(kv_home):
    writer = WriteBehind(kv_home, start_daemon=True)
    pid = writer.started_daemon
    assert pid
    try:
        protocols = []
        t = time.monotonic()
        assert writer.submit(Job("ping", lambda client: protocols.append(client.info.protocol)))
        assert writer.flush(30), "the job waited for the daemon, then ran"
        assert protocols and writer.sent == 1 and writer.dropped == 0, time.monotonic() - t
        assert lock_holder(kv_home) == pid
        assert (kv_home / "daemon.log").is_file()
        # once per home and process: a later writer waits for the same daemon
        assert spawn_daemon(kv_home)[0] == pid
        assert writer.close(5)
    finally:
        _stop(kv_home, pid)
    writer.close()


def test_nothing_is_started_beside_a_daemon_that_holds_the_home(kv_home, tmp_path):
    from helpers import Proc, serving

    with serving(Proc(kv_home, log=tmp_path / "daemon.log"), warm=False):
        assert spawn_daemon(kv_home) is None
        writer = WriteBehind(kv_home, start_daemon=True)
        assert writer.started_daemon is None
        assert writer.submit(Job("ping", lambda client: None))
        assert writer.flush(10) and writer.sent == 1
        assert writer.close(5)
