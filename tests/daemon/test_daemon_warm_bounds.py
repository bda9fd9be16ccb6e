"""The daemon's warm of long pins, in its log: each pin's token count before its prefill, a slow
prefill's progress every 10 s, a pin over max_pin_tokens refused before anything loads, and a
pin whose prefill does not fit the available memory refused before its prefill; the other pins
warm. Slowness is a clock that jumps 11 s at each reading and a 16-token chunk (deterministic);
available memory comes from a file the test writes, through the daemon's one reader."""

from __future__ import annotations

import re

from helpers import CLASSIFY, Proc, manifest_for, serving

HARNESS = """
import sys
from pathlib import Path
import kvstore.daemon.lifecycle, kvstore.kvcheck.prefill, kvstore.warm.warm
kvstore.kvcheck.prefill.PREFILL_STEP = 16
t = [0.0]
def clock():
    t[0] += 11.0
    return t[0]
kvstore.warm.warm.progress_clock = clock
def available():  # the file's numbers in turn, then its last one
    values = Path({path!r}).read_text().split()
    if len(values) > 1:
        Path({path!r}).write_text(" ".join(values[1:]))
    return int(values[0])
kvstore.daemon.lifecycle.available_memory_bytes = available
from kvstore.cli.main import main
main(["daemon", *sys.argv[1:]])
"""

PINS = f"""
[[model.prefix]]
name = "classify"
messages = [{{ role = "system", content = "{CLASSIFY}" }}]

[[model.prefix]]
name = "huge"
text = "{"one two three four five six seven eight nine ten " * 40}"

[[model.prefix]]
name = "short"
text = "You are the writer."
"""


def test_the_daemon_logs_long_pins_and_refuses_what_does_not_fit(llama_path, tmp_path):
    manifest = manifest_for(tmp_path, llama_path, PINS)
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    (home / "settings.toml").write_text("max_pin_tokens = 200\n")
    fake = tmp_path / "available"
    # the model's load check, the classify prefill's (fits), the short pin's (does not)
    fake.write_text(f"{2**40} {2**40} 1000")
    d = Proc(home, "--manifest", str(manifest), log=tmp_path / "daemon.log",
             code=HARNESS.format(path=str(fake)))  # fmt: skip
    with serving(d):
        w = d.request("stats")["daemon"]["last_warm"]
        assert (w["warmed"], w["failed"], w["models_loaded"]) == (1, 2, 1), d.text()
        assert [e["label"] for e in d.request("ls")] == ["classify"]
    log = d.text()
    lines = log.splitlines()
    said = [i for i, x in enumerate(lines) if x.endswith(":: classify: prefilling 148 tokens")]
    progress = [i for i, x in enumerate(lines) if "warm: pin classify: " in x]
    done = [i for i, x in enumerate(lines) if "warm: [1/2]" in x and "148 tokens, " in x]
    assert len(said) == 1 and len(done) == 1, log
    assert said[0] < progress[0] and progress[-1] < done[0], log
    assert len(progress) == 9, log  # a line per 16-token chunk, 11 s apart: over the 10 s interval
    assert lines[progress[0]].endswith("pin classify: 16 of 148 tokens (11%), 1 tokens/s")
    huge = re.search(r"pin 'huge' is ([\d,]+) tokens, over max_pin_tokens \(settings.toml\) of 200 "
                     r"tokens; not prefilled", log)  # fmt: skip
    assert huge and int(huge.group(1).replace(",", "")) > 200, log
    assert "huge: prefilling" not in log and "short: prefilling" not in log, log
    short = (
        r"pin 'short' \(9 tokens\) needs about [\d.]+ KiB to prefill \([\d.]+ KiB of KV and "
        r"[\d.]+ KiB of attention scratch for a 9-token chunk\), 1\.0 KiB is available; not "
        r"prefilled: free memory or shorten the pin"
    )
    assert re.search(short, log), log


def test_a_bad_max_pin_tokens_stops_the_daemon_in_one_line(llama_path, tmp_path):
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    (home / "settings.toml").write_text("max_pin_tokens = 0\n")
    manifest = manifest_for(tmp_path, llama_path, PINS)
    d = Proc(home, "--manifest", str(manifest), log=tmp_path / "daemon.log")
    assert d.p.wait(timeout=60) == 78, d.text()  # EX_CONFIG: a supervisor does not loop on it
    assert "settings.toml: max_pin_tokens must be a positive integer, got 0" in d.text()
    assert "Traceback" not in d.text()
