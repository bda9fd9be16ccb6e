"""The commands that touch no model or KV bytes start without mlx, mlx-lm, transformers or numpy
(each ~0.1-0.7 s to import): checked in a fresh interpreter, where no other test's imports count."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("mlx", "mlx_lm", "transformers", "numpy")

# Runs the command in-process, then prints the heavy top-level packages it imported.
PROBE = """
import json, sys
from kvstore.cli.main import main
code = main(sys.argv[1:], prog_name="kvstore", standalone_mode=False)
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY))
print(json.dumps({"code": code, "heavy": heavy}))
"""


@pytest.mark.parametrize(
    "argv",
    [["ls"], ["ls", "--json"], ["stats"], ["evict", "--all"], ["manifests"], ["--help"]],
    ids=lambda a: " ".join(a),
)
def test_light_commands_import_no_mlx(argv, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    args = argv if argv == ["--help"] else [*argv, "--home", str(home)]
    out = subprocess.run(
        [sys.executable, "-c", PROBE.replace("HEAVY", repr(HEAVY)), *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["code"] in (0, None), res
    assert res["heavy"] == [], f"`kvstore {' '.join(argv)}` imported {res['heavy']}"


def test_python_m_kvstore_runs_the_command(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "kvstore", "ls", "--home", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "0 entries" in out.stdout
