"""Fingerprint and template hash: what changes them, what must not, and how fast they are."""

from __future__ import annotations

import json
import os
import shutil

import mlx.core as mx
import pytest

from kvstore.errors import ModelError
from kvstore.identity.fingerprint import (
    FileHashCache,
    model_fingerprint,
    resolve_model_path,
    template_hash,
)
from kvstore.identity.model import ModelIdentity
from kvstore.store.entry import entry_key, prefix_hash


def fp(path, *, hash_cache=None, **identity):
    """The fingerprint of `path` run as `identity` (ModelIdentity's fields) says."""
    return model_fingerprint(ModelIdentity(str(path), **identity), hash_cache=hash_cache).digest


def test_fingerprint_is_stable_and_sized(model_copy):
    a, b = fp(model_copy), fp(model_copy)
    assert a == b and len(a) == 16
    assert len(entry_key(a, [1, 2, 3])) == 32
    assert entry_key(a, [1, 2, 3])[:16] == a


def test_weight_change_changes_fingerprint(model_copy, tmp_path):
    cache = FileHashCache(tmp_path / "fh.msgpack")
    before = fp(model_copy, hash_cache=cache)
    weights = model_copy / "model.safetensors"
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit in the middle of the tensor data
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with the old mtime restored
    assert fp(model_copy, hash_cache=FileHashCache(tmp_path / "fh.msgpack")) != before


def test_config_adapter_kvbits_change_fingerprint(model_copy, tmp_path):
    base = fp(model_copy)
    assert fp(model_copy, kv_bits=8) != base
    assert fp(model_copy, kv_bits=8, kv_group_size=32) != fp(model_copy, kv_bits=8)
    assert fp(model_copy, kv_group_size=32) == base  # group size means nothing unquantized

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"rank": 4}))
    mx.save_safetensors(str(adapter / "adapters.safetensors"), {"a": mx.zeros((2, 2))})
    with_adapter = fp(model_copy, adapter=str(adapter))
    assert with_adapter != base
    mx.save_safetensors(str(adapter / "adapters.safetensors"), {"a": mx.ones((2, 2))})
    assert fp(model_copy, adapter=str(adapter)) != with_adapter

    config = json.loads((model_copy / "config.json").read_text())
    config["rms_norm_eps"] = 1e-6
    (model_copy / "config.json").write_text(json.dumps(config))
    assert fp(model_copy) != base


def test_layout_is_part_of_identity(model_copy):
    config = json.loads((model_copy / "config.json").read_text())
    base = model_fingerprint(model_copy)
    assert base.layout == (("KVCache",), ("KVCache",))
    assert model_fingerprint(model_copy, layout=(("KVCache",),)).digest != base.digest
    assert config["num_hidden_layers"] == 2


def test_touch_does_not_change_fingerprint_and_cache_is_used(model_copy, tmp_path):
    path = tmp_path / "fh.msgpack"
    before = fp(model_copy, hash_cache=FileHashCache(path))
    assert path.is_file()
    os.utime(model_copy / "model.safetensors")  # touched, same bytes
    assert fp(model_copy, hash_cache=FileHashCache(path)) == before
    # a cached identity skips reading: a fake digest in the cache is what gets used
    cache = FileHashCache(path)
    key = str(model_copy / "model.safetensors")
    cache._data[key][5] = b"\xff" * 16
    assert fp(model_copy, hash_cache=cache) != before


def test_template_hash_is_provenance_not_identity(model_copy):
    fp_before, th_before = fp(model_copy), template_hash(model_copy)
    cfg_path = model_copy / "tokenizer_config.json"
    jinja = model_copy / "chat_template.jinja"
    if jinja.is_file():
        jinja.write_text(jinja.read_text() + "{# changed #}")
    else:
        cfg = json.loads(cfg_path.read_text())
        cfg["chat_template"] += "{# changed #}"
        cfg_path.write_text(json.dumps(cfg))
    assert template_hash(model_copy) != th_before
    assert fp(model_copy) == fp_before


def test_missing_model_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelError, match="no such directory"):
        resolve_model_path(tmp_path / "nope")
    with pytest.raises(ModelError, match="local hub cache"):
        resolve_model_path("mlx-community/not-downloaded-model")


def test_hub_id_resolves_from_local_cache_only(llama_path, tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    snap = hub / "models--acme--tiny" / "snapshots" / "abc123"
    shutil.copytree(llama_path, snap)
    (hub / "models--acme--tiny" / "refs").mkdir()
    (hub / "models--acme--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    assert resolve_model_path("acme/tiny") == snap
    assert fp("acme/tiny") == fp(llama_path)


def test_prefix_hash_depends_on_every_token():
    assert prefix_hash([1, 2, 3]) != prefix_hash([1, 2, 4])
    assert prefix_hash([1, 2, 3]) != prefix_hash([1, 2, 3, 0])


def test_cached_fingerprint_reads_no_weights(llama_path, tmp_path):
    from unittest import mock

    cache_path = tmp_path / "fh.msgpack"
    first = fp(llama_path, hash_cache=FileHashCache(cache_path))
    with mock.patch(
        "kvstore.identity.fingerprint.hash_file", side_effect=AssertionError("read weights")
    ):
        assert fp(llama_path, hash_cache=FileHashCache(cache_path)) == first


def test_fingerprint_files_are_the_top_level_matches(model_copy):
    """The files the fingerprint reads, from one directory listing: a shard reached through a
    symlink counts; a directory named like a shard and a shard in a subdirectory do not."""
    from kvstore.identity.fingerprint import WEIGHT_GLOBS, _files

    weights = model_copy / "model.safetensors"
    (model_copy / "shard-2.safetensors").symlink_to(weights)
    (model_copy / "dir.safetensors").mkdir()
    (model_copy / "sub").mkdir()
    shutil.copy(weights, model_copy / "sub" / "other.safetensors")
    (model_copy / "notes.txt").write_text("x")
    names = [p.name for p in _files(model_copy, WEIGHT_GLOBS)]
    assert names == sorted(p.name for g in WEIGHT_GLOBS for p in model_copy.glob(g) if p.is_file())
    assert "shard-2.safetensors" in names and "config.json" in names
    assert not {"dir.safetensors", "other.safetensors", "notes.txt"} & set(names)
