"""The remembered cache layout is the one config.json gives, and a changed config rebuilds it."""

from __future__ import annotations

import json
import shutil

from client.layout_cache import LAYOUT_CACHE_NAME, cached_layout
from kvstore.identity import cache_layout, model_fingerprint


def test_cached_layout_equals_the_built_one_and_follows_config(hybrid_path, tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    model = tmp_path / "model"
    shutil.copytree(hybrid_path, model)
    built = cache_layout(model)
    assert cached_layout(model, home) == built  # miss: built and stored
    assert (home / LAYOUT_CACHE_NAME).is_file()
    calls = []
    monkeypatch.setattr("client.layout_cache.cache_layout", lambda d: calls.append(d) or built)
    hit = cached_layout(model, home)
    assert hit == built and calls == []  # hit: not rebuilt, and tuples as the fingerprint hashes
    assert model_fingerprint(model, layout=hit) == model_fingerprint(model)
    config = json.loads((model / "config.json").read_text())
    config["text_config"]["full_attention_interval"] = 4
    (model / "config.json").write_text(json.dumps(config))
    cached_layout(model, home)
    assert calls == [model.resolve()]  # a changed config is a miss


def test_a_damaged_layout_cache_only_costs_a_rebuild(llama_path, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / LAYOUT_CACHE_NAME).write_bytes(b"\xc1 not msgpack")
    assert cached_layout(llama_path, home) == cache_layout(llama_path)
