"""Fixtures of the CLI tests (every `kvstore` command, run in-process through helpers.cli)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import TWO_PINS, cli, manifest_for


@pytest.fixture
def warmed(llama_path, kv_home, tmp_path) -> Path:
    """A manifest of TWO_PINS, warmed by `kvstore warm` into this test's home."""
    manifest = manifest_for(tmp_path, llama_path, TWO_PINS)
    assert "2 warmed" in cli("warm", "--manifest", manifest, code=0).output
    return manifest
