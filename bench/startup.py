"""How fast the `kvstore` command starts: `kvstore ls` on an empty home and `kvstore --help`, each
a fresh process, against `python -c "import lmdb, click"` (the least any command needs). Commands
that touch no model must not pay for mlx, mlx-lm or transformers.

    python -m bench.startup                      # this checkout's interpreter
    python -m bench.startup --python OTHER/.venv/bin/python --cli kvstore.cli.main  # an older one
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from bench.timing import Stats, fresh_rounds

BASELINE = "import lmdb, click"


def measure(python: str, cli: str, reps: int) -> dict:
    """Median wall time of each command over `reps` fresh processes, and each over the baseline."""
    with tempfile.TemporaryDirectory(prefix="kvbench-startup-") as home:
        # the other interpreter's own packages: no checkout on its path
        env = dict(os.environ, KVSTORE_HOME=home, TRANSFORMERS_VERBOSITY="error")
        cases = {
            "import lmdb, click": ["-c", BASELINE],
            "kvstore ls (empty home)": ["-m", cli, "ls", "--home", home],
            "kvstore --help": ["-m", cli, "--help"],
        }
        runs = fresh_rounds(cases, reps=reps, python=python, env=env, cwd=Path(home))
        stats = {k: Stats.of([r["process_s"] for r in v]) for k, v in runs.items()}
    base = stats["import lmdb, click"].median
    out = {k: v.to_json() for k, v in stats.items()}
    out["ratios"] = {k: v.median / base for k, v in stats.items() if k != "import lmdb, click"}
    for k, v in stats.items():
        print(f"  {k:26} {v.median * 1e3:7.1f} ms  {v.median / base:5.2f}x the baseline")
    return out


def run(quick: bool) -> dict:
    return measure(sys.executable, "kvstore", reps=10 if quick else 30)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--cli", default="kvstore", help="the module `python -m` runs as the command")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    print(json.dumps(measure(a.python, a.cli, a.reps)["ratios"]))
