"""Fixtures of the warm tests (prefill, import, canary, warming on a full disk)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import tiny_model


@pytest.fixture(scope="session")
def sliding_path(models_dir) -> Path:
    """A tiny model with sliding-window layers (gemma3_text: RotatingKVCache)."""
    return tiny_model(models_dir, "gemma3_text")
