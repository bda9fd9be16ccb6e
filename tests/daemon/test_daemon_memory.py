"""The daemon loads a model to warm only when the memory it needs is available: short of it, the
warm is deferred (said once, in the warm's reply, in `kvstore stats` and in the log) and retried
when memory allows, without a restart. Available memory is faked by patching the one function
that reads it, in the daemon process."""

from __future__ import annotations

import sys
import time

from helpers import CLASSIFY, Proc, cli, manifest_for, serving, wait_for

from kvstore.daemon.lifecycle import available_memory_bytes, memory_to_load

FAKE_MEMORY = """
import sys
from pathlib import Path
import kvstore.daemon.lifecycle
kvstore.daemon.lifecycle.available_memory_bytes = lambda: int(Path({path!r}).read_text())
from kvstore.cli.main import main
main(["daemon", *sys.argv[1:]])
"""


def test_available_memory_is_read_on_this_platform():
    avail = available_memory_bytes()
    if sys.platform.startswith("linux"):
        line = next(x for x in open("/proc/meminfo") if x.startswith("MemAvailable:"))
        assert abs(avail - int(line.split()[1]) * 1024) < 2**30  # within a GiB of a moment later
    assert avail is None or avail > 0


def test_a_warm_short_of_memory_is_deferred_then_done_when_memory_allows(tmp_path, llama_path):
    (tmp_path / "router.md").write_text(CLASSIFY)
    pins = (
        '[[model.prefix]]\nname = "router"\nfile = "router.md"\n\n'
        '[[model.prefix]]\nname = "writer"\ntext = "You are the writer."\n'
    )
    manifest = manifest_for(tmp_path, llama_path, pins, name="pins.toml")
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    (home / "settings.toml").write_text("memory_check_interval = 0.2\n")
    fake = tmp_path / "available"
    need = memory_to_load(llama_path, None)
    fake.write_text(str(need - 1))  # one byte short
    d = Proc(home, "--manifest", str(manifest), log=tmp_path / "daemon.log",
             code=FAKE_MEMORY.format(path=str(fake)))  # fmt: skip
    with serving(d):
        w = d.wait_warm()
        assert (w["deferred"], w["warmed"], w["models_loaded"]) == (2, 0, 0), d.text()
        assert d.request("ls") == []
        deferred = d.request("stats")["daemon"]["deferred"]
        assert list(deferred) == [str(manifest)] and deferred[str(manifest)]["need"] == need
        assert "not enough memory to load model" in deferred[str(manifest)]["reason"]

        args = ["--home", str(home)]
        r = cli("warm", "--manifest", manifest, *args)
        assert r.exit_code == 0, r.output
        assert r.output.count("deferred  ") == 2 and "2 deferred" in r.output, r.output
        r = cli("stats", *args)
        assert f"deferred       warm of {manifest}: not enough memory" in r.output, r.output

        time.sleep(1.0)  # several re-checks, none of which may load or say it again
        assert d.text().count("pin(s) deferred") == 1, d.text()
        assert "loading" not in d.text() and d.request("ls") == []

        fake.write_text(str(need))  # memory is available now
        wait_for(lambda: not d.request("stats")["daemon"]["deferred"], what=d.text)
        stats = d.request("stats")["daemon"]
        assert stats["pid"] == d.pid and len(d.request("ls")) == 2
        assert stats["last_warm"]["cause"] == "memory available"
        assert (stats["last_warm"]["warmed"], stats["last_warm"]["models_loaded"]) == (2, 1)
        d.wait_log("no longer deferred")
