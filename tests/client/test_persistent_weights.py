"""A pin's KV is filed only under the fingerprint of the weights that computed it, however the
model was loaded: a model from plain `mlx_lm.load` is compared with its files (a sample of its
weights) when a PersistentPromptCache or hydrate takes it, and the files are re-checked before
each store. Through a real daemon process."""

from __future__ import annotations

import logging
import os

import mlx_lm
import pytest
from helpers import CLASSIFY, SYNTHESIZE, TWO_PINS, assert_same_kv, manifest_for
from mlx_lm.models.cache import LRUPromptCache

from kvstore import client
from kvstore.client import PersistentPromptCache
from kvstore.client.hydrate import hydrate
from kvstore.kvcheck.prefill import prefill
from kvstore.ops.warm import warm
from kvstore.pins.manifest import load_manifest
from kvstore.store.store import Store
from kvstore.tiny import make_tiny_model
from kvstore.wire.daemon_client import DaemonClient

ROUTER = [{"role": "system", "content": CLASSIFY}]
WRITER = [{"role": "system", "content": SYNTHESIZE}]


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory) -> bytes:
    """Another weight set of the same architecture (an update of the model's files)."""
    path = make_tiny_model(tmp_path_factory.mktemp("other") / "llama", "llama", seed=1)
    return (path / "model.safetensors").read_bytes()


def rewrite_in_place(model_dir, data: bytes) -> None:
    with open(model_dir / "model.safetensors", "r+b") as f:  # same inode: an in-place update
        f.write(data)
        f.truncate()


def ls(home) -> list[dict]:
    with DaemonClient(home) as c:
        return c.raw("ls")


def test_a_plain_load_whose_files_changed_before_the_cache_files_no_pin(
    daemon, model_copy, new_weights, caplog
):
    model, tokenizer = mlx_lm.load(str(model_copy))  # the old weights, in memory
    rewrite_in_place(model_copy, new_weights)
    with caplog.at_level(logging.WARNING, "kvstore"):
        with PersistentPromptCache.open(model, tokenizer, model_copy, home=daemon.home) as cache:
            pin = cache.pin("late", messages=ROUTER)
            assert cache.flush()
    assert cache.fingerprint is None and pin.queued is False
    assert "the loaded weights are not those in" in cache.report.warning
    assert any("the loaded weights are not those" in r.getMessage() for r in caplog.records)
    assert ls(daemon.home) == []
    # a fresh load of the files as they are now finds nothing of the old weights to hydrate
    _, _, fresh = client.load(model_copy, home=daemon.home, stats=False)
    assert fresh.report.entries == 0 and len(fresh) == 0


def test_hydrate_refuses_a_plain_load_whose_files_changed(
    model_copy, new_weights, kv_home, tmp_path
):
    model, _ = mlx_lm.load(str(model_copy))
    rewrite_in_place(model_copy, new_weights)
    with Store(kv_home) as store:  # KV of the new weights, under their fingerprint
        warm(load_manifest(manifest_for(tmp_path, model_copy, TWO_PINS)), store, home=kv_home)
    lru = LRUPromptCache()
    report = hydrate(lru, "m", model_copy, home=kv_home, model=model)
    assert report.entries == 0 and len(lru) == 0
    assert "the loaded weights are not those in" in report.warning


def test_files_changed_after_the_cache_was_built_store_nothing_and_warn_once(
    daemon, model_copy, new_weights, caplog
):
    model, tokenizer = mlx_lm.load(str(model_copy))
    with caplog.at_level(logging.WARNING, "kvstore"):
        with PersistentPromptCache.open(model, tokenizer, model_copy, home=daemon.home) as cache:
            assert cache.fingerprint is not None
            rewrite_in_place(model_copy, new_weights)
            cache.pin("a", messages=ROUTER)
            assert cache.flush()
            later = cache.pin("b", messages=WRITER)
            assert cache.flush()
    assert ls(daemon.home) == []
    assert later.queued is False  # known stale: not even queued
    said = [r for r in caplog.records if "changed on disk since this model" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]


def test_unchanged_or_touched_files_still_store_and_hydrate(daemon, model_copy):
    model, tokenizer = mlx_lm.load(str(model_copy))
    with PersistentPromptCache.open(model, tokenizer, model_copy, home=daemon.home) as cache:
        first = cache.pin("first", messages=ROUTER)
        assert cache.flush()
        os.utime(model_copy / "model.safetensors")  # new mtime, same bytes
        second = cache.pin("second", messages=WRITER)
        assert cache.flush()
    assert first.queued and second.queued
    assert sorted(e["label"] for e in ls(daemon.home)) == ["first", "second"]
    fresh_model, _, fresh = client.load(model_copy, home=daemon.home, stats=False)
    assert fresh.report.entries == 2
    hydrated, rest = fresh.fetch_nearest_cache(fresh.model_key, [*first.tokens, 7])
    assert rest == [7]
    assert_same_kv(hydrated, prefill(fresh_model, first.tokens))
