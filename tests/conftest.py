"""Shared fixtures: tiny generated models (never downloaded), an isolated home per test."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvstore.tiny import make_tiny_model

ARCHS = ("llama", "qwen3_5", "gemma3_text")


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


def _model(models_dir: Path, arch: str) -> Path:
    path = models_dir / arch
    if not (path / "config.json").is_file():
        make_tiny_model(path, arch)
    return path


@pytest.fixture(scope="session")
def llama_path(models_dir) -> Path:
    return _model(models_dir, "llama")


@pytest.fixture(scope="session")
def hybrid_path(models_dir) -> Path:
    return _model(models_dir, "qwen3_5")


@pytest.fixture(scope="session")
def sliding_path(models_dir) -> Path:
    return _model(models_dir, "gemma3_text")


@pytest.fixture(scope="session", params=ARCHS)
def any_model_path(request, models_dir) -> Path:
    return _model(models_dir, request.param)


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


def write_manifest(path: Path, body: str) -> Path:
    path.write_text(body)
    return path
