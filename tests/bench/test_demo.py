"""`make demo` end to end: daemon boot warm, fresh app process, hydrated calls prefill only their
dynamic suffix and give the same output as calls without the store."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_demo_runs_and_hydrated_calls_prefill_only_the_suffix(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("KVSTORE_HOME", None)  # the demo keeps everything under its own .demo/
    proc = subprocess.run(
        [sys.executable, "-m", "bench.demo"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split("|") for line in proc.stdout.splitlines() if line.count("|") == 6]
    stages = {r[0].strip(): r for r in rows[2:]}
    assert set(stages) == {"classify", "reason", "examine", "synthesize"}
    for r in stages.values():
        prompt, stored, prefilled = (int(x) for x in r[1:4])
        assert stored > 0 and prefilled == prompt - stored and prefilled < prompt // 4
        assert r[6].strip() == "yes"
    assert "4 pins warmed" in proc.stdout
    assert sorted(p.name for p in (tmp_path / ".demo").iterdir()) == [
        "home",
        "manifest.toml",
        "model",
        "prompts",
        "tools.json",
    ]
