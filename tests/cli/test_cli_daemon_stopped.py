"""A daemon that holds the store but does not answer (SIGSTOP, hung) is never written beside."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import TWO_PINS, Proc, cli, manifest_for, serving

from kvstore.store.store import Store

pytestmark = pytest.mark.slow


def _labels(home) -> list[str]:
    with Store(home, readonly=True) as store:
        return sorted(m.label for m in store.metas())


def test_a_stopped_daemon_is_named_and_nothing_is_written_beside_it(llama_path, tmp_path):
    home = tmp_path / "h"
    manifest = manifest_for(tmp_path, llama_path, TWO_PINS)
    with serving(Proc(home, "--manifest", str(manifest), log=tmp_path / "d.log")) as d:
        r = cli("evict", "--label", "synthesize", "--home", home)
        assert r.exit_code == 0, r.output  # through the daemon while it answers
        said = f"the daemon (pid {d.pid}) holds this store but does not answer"
        os.kill(d.pid, signal.SIGSTOP)
        try:
            for argv in (["evict", "--all"], ["warm", "--manifest", str(manifest)]):
                r = cli(*argv, "--home", home)
                assert r.exit_code == 1 and said in r.output, (argv, r.output)
                assert _labels(home) == ["classify"], argv  # nothing evicted, nothing warmed
            # a read: the stats from the store, the daemon named, exit 0 (issue 43 item 8: it
            # ended "Error: ... nothing was written" with exit 1)
            r = cli("stats", "--home", home)
            assert r.exit_code == 0 and "not running" not in r.output, r.output
            assert f"pid {d.pid}: holds this store but does not answer" in r.output
            assert "Error" not in r.output and "nothing was written" not in r.output
            r = cli("stats", "--json", "--home", home)
            assert r.exit_code == 0, r.output
            data = json.loads(r.output)
            assert data["daemon"] == {"pid": d.pid, "answers": False} and data["entries"] == 1

            # --wait: the command waits for the daemon, and the daemon does the write
            waiting = subprocess.Popen(
                [sys.executable, "-m", "kvstore", "evict", "--all", "--wait", "60",
                 "--home", str(home)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip
            time.sleep(3.0)
            assert waiting.poll() is None  # still waiting
            assert _labels(home) == ["classify"]
        finally:
            os.kill(d.pid, signal.SIGCONT)
        out, _ = waiting.communicate(timeout=60)
        assert waiting.returncode == 0 and "evicted 1 entry" in out, out
        assert _labels(home) == []
        assert "evicted" in d.text() and "requested" in d.text()  # the daemon did the delete
