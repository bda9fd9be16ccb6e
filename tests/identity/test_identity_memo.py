"""What the fingerprint derives from config.json and mlx-lm's source (the built model's arguments,
its cache layout, the code digest) is remembered in the home's hash cache, so a new process skips
building the architecture; the memo is void once a source file it was derived from changes."""

from __future__ import annotations

from unittest import mock

from kvstore.identity import fingerprint as identity
from kvstore.identity.fingerprint import FileHashCache, model_fingerprint
from kvstore.identity.model import ModelIdentity


def test_a_remembered_derivation_gives_the_same_fingerprint(llama_path, hybrid_path, tmp_path):
    for path in (llama_path, hybrid_path):
        memo = tmp_path / f"{path.name}.msgpack"
        plain = model_fingerprint(path)  # nothing remembered: everything computed
        first = model_fingerprint(path, hash_cache=FileHashCache(memo))
        again = model_fingerprint(path, hash_cache=FileHashCache(memo))  # a new process's view
        assert plain.digest == first.digest == again.digest
        assert plain.layout == again.layout and isinstance(again.layout[0], tuple)
    # overrides are in the memo's key (llama reads rope_theta at the top level of its config)
    memo = tmp_path / f"{llama_path.name}.msgpack"
    override = {"rope_theta": 1234.0}
    overridden = ModelIdentity(str(llama_path), model_config=override)
    remembered = model_fingerprint(overridden, hash_cache=FileHashCache(memo))
    assert remembered.digest == model_fingerprint(overridden).digest
    assert remembered.digest != model_fingerprint(llama_path).digest


def test_the_memo_skips_the_build_and_a_changed_source_file_voids_it(
    llama_path, tmp_path, monkeypatch
):
    source = tmp_path / "llama.py"
    source.write_text("x = 1\n")
    monkeypatch.setattr(identity, "kv_code_files", lambda config, **kw: [source])
    memo = tmp_path / "filehash.msgpack"
    with mock.patch.object(
        identity, "build_architecture", wraps=identity.build_architecture
    ) as build:
        first = model_fingerprint(llama_path, hash_cache=FileHashCache(memo)).digest
        assert build.call_count == 1
        assert model_fingerprint(llama_path, hash_cache=FileHashCache(memo)).digest == first
        assert build.call_count == 1  # remembered: no architecture built
        source.write_text("x = 22\n")  # an upgrade rewrites the file in place
        assert model_fingerprint(llama_path, hash_cache=FileHashCache(memo)).digest == first
        assert build.call_count == 2  # void: derived again from the source as it is now


def test_a_changed_config_is_a_miss_and_the_layout_follows_it(hybrid_path, tmp_path):
    import json
    import shutil

    from kvstore.identity.fingerprint import cache_layout

    model = tmp_path / "model"
    shutil.copytree(hybrid_path, model)
    memo = tmp_path / "filehash.msgpack"
    remembered = model_fingerprint(model, hash_cache=FileHashCache(memo)).layout
    assert remembered == cache_layout(model)
    config = json.loads((model / "config.json").read_text())
    config["text_config"]["full_attention_interval"] = 4
    (model / "config.json").write_text(json.dumps(config))
    with mock.patch.object(
        identity, "build_architecture", wraps=identity.build_architecture
    ) as build:
        changed = model_fingerprint(model, hash_cache=FileHashCache(memo)).layout
    assert build.call_count == 1 and changed == cache_layout(model) != remembered


def test_a_damaged_hash_cache_only_costs_a_rebuild(llama_path, tmp_path):
    memo = tmp_path / "filehash.msgpack"
    memo.write_bytes(b"\xc1 not msgpack")
    assert model_fingerprint(llama_path, hash_cache=FileHashCache(memo)) == model_fingerprint(
        llama_path
    )
