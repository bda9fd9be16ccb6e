"""Fixtures of the client tests (load, hydrate, PersistentPromptCache, serve, stats): the tiny
llama loaded once per module, a daemon process per module emptied for each test, and every
architecture in turn."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import Proc, serving, tiny_model
from mlx_lm import load

ARCHS = ("llama", "qwen3_5", "gemma3_text")


@pytest.fixture(scope="session", params=ARCHS)
def any_model_path(request, models_dir) -> Path:
    return tiny_model(models_dir, request.param)


@pytest.fixture(scope="module")
def llama(llama_path):
    """(model, tokenizer) of the tiny llama, loaded by mlx_lm once for the module."""
    return load(str(llama_path))


@pytest.fixture(scope="module")
def daemon_proc(tmp_path_factory):
    """A `kvstore daemon` process for the module (no manifest)."""
    root = tmp_path_factory.mktemp("client-daemon")
    with serving(Proc(root / "home", log=root / "daemon.log"), warm=False) as d:
        yield d


@pytest.fixture
def daemon(daemon_proc):
    """The module's daemon with an empty store for each test."""
    daemon_proc.request("evict", all=True)
    return daemon_proc
