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
import subprocess
import sys
import tempfile

from bench.timing import interleave

BASELINE = "import lmdb, click"


def measure(python: str, cli: str, reps: int) -> dict:
    """Median wall time of each command over `reps` fresh processes, and each over the baseline."""
    with tempfile.TemporaryDirectory(prefix="kvbench-startup-") as home:
        env = dict(os.environ, KVSTORE_HOME=home, TRANSFORMERS_VERBOSITY="error")

        def runs(*argv: str):
            def go() -> None:
                subprocess.run([python, *argv], check=True, capture_output=True, env=env, cwd=home)

            return go

        stats = interleave(
            {
                "import lmdb, click": runs("-c", BASELINE),
                "kvstore ls (empty home)": runs("-m", cli, "ls", "--home", home),
                "kvstore --help": runs("-m", cli, "--help"),
            },
            reps=reps,
        )
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
