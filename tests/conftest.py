"""Fixtures every area uses: tiny generated models (never downloaded) and a copy of one to
edit, an isolated home per test, and a check that no test leaks a thread. An area's own fixtures
are in its folder's conftest.py."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
from helpers import tiny_model


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def llama_path(models_dir) -> Path:
    return tiny_model(models_dir, "llama")


@pytest.fixture(scope="session")
def hybrid_path(models_dir) -> Path:
    return tiny_model(models_dir, "qwen3_5")


@pytest.fixture
def model_copy(llama_path, tmp_path) -> Path:
    """The tiny llama copied into this test's folder, for a test that edits a model's files."""
    dst = tmp_path / "model"
    shutil.copytree(llama_path, dst)
    return dst


@pytest.fixture(autouse=True)
def kv_home(tmp_path, monkeypatch) -> Path:
    """Every test gets its own home; nothing touches the user's real one."""
    home = tmp_path / "home"
    monkeypatch.setenv("KVSTORE_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


@pytest.fixture(autouse=True)
def no_leaked_threads():
    before = set(threading.enumerate())
    yield
    leaked = [t for t in threading.enumerate() if t not in before and t.is_alive() and not t.daemon]
    assert not leaked, f"test leaked threads: {leaked}"
