"""A home the library cannot use (a path under a file, an immutable directory) costs the app one
warning and a normal prefill, never a traceback (issue 21's bad --home, library side)."""

from __future__ import annotations

import subprocess

import pytest
from mlx_lm import load

from kvstore.client import hydrate
from kvstore.client.persistent import PersistentPromptCache


@pytest.fixture(scope="module")
def loaded(llama_path):
    return load(str(llama_path))


def test_a_home_under_a_file_is_one_warning(tmp_path, llama_path, loaded):
    from mlx_lm.server import LRUPromptCache

    (tmp_path / "FILE").write_text("a regular file")
    model, _ = loaded
    report = hydrate(LRUPromptCache(), "m", llama_path, home=tmp_path / "FILE" / "sub", model=model)
    assert report.entries == 0 and report.warning and "FILE" in report.warning
    assert "\n" not in report.warning


def test_an_immutable_home_is_one_warning(tmp_path, llama_path, loaded):
    home = tmp_path / "h"
    home.mkdir(mode=0o755)
    if subprocess.run(["chattr", "+i", str(home)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    try:
        model, tokenizer = loaded
        with PersistentPromptCache.open(model, tokenizer, llama_path, home=home, stats=False) as c:
            assert c.report.entries == 0 and c.report.warning and str(home) in c.report.warning
    finally:
        subprocess.run(["chattr", "-i", str(home)], check=True)
