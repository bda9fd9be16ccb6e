"""docs/integrations.md's framework recipes run as written: each `python` block of the "In-process
frameworks" section in a new process, on the tiny generated llama in place of the hub model it
names, and the install line names this project's `integrations` extra and the versions tested."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integrations.frameworks import PACKAGES

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "integrations.md").read_text()
SECTION = DOC.split("\n## In-process frameworks", 1)[1].split("\n## ", 1)[0]
BLOCKS = re.findall(r"```python\n(.*?)```", SECTION, re.S)
HUB_MODEL = '"mlx-community/Qwen3-4B-4bit"'


def programs() -> list[tuple[str, str]]:
    """(the package it needs, the program) of each block."""
    needs = (*PACKAGES.values(), "llama_index", "mlx_lm")
    return [(next(n for n in needs if n in block), block) for block in BLOCKS]


def have(need: str) -> bool:
    return (
        importlib.util.find_spec("llama_index.llms.mlx" if need == "llama_index" else need)
        is not None
    )


@pytest.mark.parametrize("need,program", programs(), ids=[n for n, _ in programs()])
def test_each_recipe_runs_as_written(need, program, llama_path, kv_home, tmp_path):
    if not have(need):
        pytest.skip(f"{need} is not installed")
    assert HUB_MODEL in program
    code = program.replace(HUB_MODEL, repr(str(llama_path)))
    script = tmp_path / "recipe.py"  # a file: smolagents' @tool reads its function's source
    script.write_text(code)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**os.environ, "KVSTORE_HOME": str(kv_home), "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("kvstore: default: ")]
    if "agent.run" in code or "generator(" in code:  # the recipes that generate: each call
        assert lines, proc.stderr[-3000:]  # went through the attached cache
    if need == "mlx_lm":
        assert proc.stdout.split()[1:4] == ["prompt", "tokens,", "0"], proc.stdout


def test_the_install_line_names_the_extra_the_tests_run():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert "/path/to/kvstore[integrations]" in SECTION
    for pin in extras["integrations"]:
        name, version = pin.split("==")
        assert f"{name} {version}" in SECTION, pin  # the docs name the versions tested
