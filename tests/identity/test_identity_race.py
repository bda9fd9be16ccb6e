"""Issue 10 item 4: weights that change between fingerprint and load never file or serve KV.

The daemon fingerprints, then loads; the app loads, then fingerprints. A weight file rewritten in
between is simulated by wrapping the real mlx_lm.load.
"""

from __future__ import annotations

import logging
from unittest import mock

import mlx_lm
from helpers import TWO_PINS, manifest_for
from mlx_lm.models.cache import LRUPromptCache

from kvstore import client
from kvstore.client.hydrate import hydrate
from kvstore.ops.warm import warm
from kvstore.pins.manifest import load_manifest
from kvstore.store.store import Store

REAL_LOAD = mlx_lm.load


def rewrite_weights(model_dir) -> None:
    """Another weight set of the same size: one bit flipped in the tensor data."""
    weights = model_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))


def test_the_daemon_refuses_to_store_when_weights_change_while_it_loads(
    model_copy, kv_home, tmp_path, caplog
):
    def load_during_an_update(path, *a, **kw):
        rewrite_weights(model_copy)  # after plan_model fingerprinted, before the weights are read
        return REAL_LOAD(path, *a, **kw)

    manifest = load_manifest(manifest_for(tmp_path, model_copy, TWO_PINS))
    with Store(kv_home) as store, caplog.at_level(logging.ERROR, "kvstore"):
        with mock.patch("mlx_lm.load", load_during_an_update):
            report = warm(manifest, store, home=kv_home)
        assert store.metas() == []
    assert [p.status for p in report.pins] == ["failed", "failed"]
    assert "model.safetensors changed while the daemon loaded model" in report.pins[0].error
    assert any("changed while" in r.getMessage() for r in caplog.records)
    # once the files settle, the next warm stores them
    with Store(kv_home) as store:
        assert warm(manifest, store, home=kv_home).warmed == 2


def test_the_app_does_not_hydrate_a_model_whose_weights_changed_while_loading(
    model_copy, kv_home, tmp_path, caplog
):
    def load_during_an_update(path, *a, **kw):
        rewrite_weights(
            model_copy
        )  # kvstore.client.load fingerprinted the old files; these are read
        return REAL_LOAD(path, *a, **kw)

    with mock.patch("mlx_lm.load", load_during_an_update), caplog.at_level(logging.ERROR):
        model, _, _ = client.load(model_copy, home=kv_home, stats=False)
    assert any("changed while" in r.getMessage() for r in caplog.records)
    with Store(kv_home) as store:  # the store holds KV of the files as they are now
        warm(load_manifest(manifest_for(tmp_path, model_copy, TWO_PINS)), store, home=kv_home)
    lru = LRUPromptCache()
    report = hydrate(lru, "m", model_copy, home=kv_home, model=model)
    assert report.entries == 0 and len(lru) == 0
    assert "changed while it was loading" in report.warning


def test_the_app_does_not_hydrate_when_weights_change_after_loading(model_copy, kv_home, tmp_path):
    # the old weights, in memory
    model, tokenizer, _ = client.load(model_copy, home=kv_home, stats=False)
    rewrite_weights(model_copy)
    with Store(kv_home) as store:  # KV of the new weights, under their fingerprint
        warm(load_manifest(manifest_for(tmp_path, model_copy, TWO_PINS)), store, home=kv_home)
    report = hydrate(LRUPromptCache(), "m", model_copy, home=kv_home, model=model)
    assert report.entries == 0
    assert "changed since the model was loaded" in report.warning
    # nor does a PersistentPromptCache of it hydrate, or send its pins to be stored
    with client.PersistentPromptCache.open(model, tokenizer, model_copy, home=kv_home) as cache:
        assert cache.fingerprint is None and len(cache) == 0
        assert cache.pin("p", tokens=[1, 2, 3, 4]).queued is False
    # the same model loaded again hydrates them
    again, _, _ = client.load(model_copy, home=kv_home, stats=False)
    assert hydrate(LRUPromptCache(), "m", model_copy, home=kv_home, model=again).entries == 2


def test_a_touched_but_unchanged_file_still_hydrates(model_copy, kv_home, tmp_path):
    import os

    model, _, _ = client.load(model_copy, home=kv_home, stats=False)
    os.utime(model_copy / "model.safetensors")  # new mtime, same bytes
    with Store(kv_home) as store:
        warm(load_manifest(manifest_for(tmp_path, model_copy, TWO_PINS)), store, home=kv_home)
    assert hydrate(LRUPromptCache(), "m", model_copy, home=kv_home, model=model).entries == 2
