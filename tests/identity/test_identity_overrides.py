"""Issue 10 item 1: load-time overrides (`mlx_lm.load(model_config=...)`) are in the fingerprint.

The reproduction: a tiny llama loaded with a RoPE base override computes other KV for the same
tokens; before the fix it fingerprinted like the file's config and hydrated that config's KV.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers import CLASSIFY, assert_same_kv, manifest_for
from mlx_lm import load
from mlx_lm.models.cache import LRUPromptCache

from kvstore.client.hydrate import hydrate
from kvstore.identity.fingerprint import model_fingerprint
from kvstore.identity.model import ModelIdentity
from kvstore.kvcheck.prefill import prefill
from kvstore.ops.warm import warm
from kvstore.pins.manifest import load_manifest
from kvstore.store.store import Store

OVERRIDE = {"rope_theta": 1_000_000.0}  # the file's llama config runs with the default 10000
PIN = f"""
[[model.prefix]]
name = "classify"
messages = [{{ role = "system", content = "{CLASSIFY}" }}]
"""


def test_override_changes_kv_and_the_fingerprint(llama_path):
    plain, _ = load(str(llama_path))
    overridden, _ = load(str(llama_path), model_config=OVERRIDE)
    tokens = list(range(3, 40))
    a, b = prefill(plain, tokens), prefill(overridden, tokens)
    diff = mx.abs(a[0].keys[..., : len(tokens), :] - b[0].keys[..., : len(tokens), :]).max().item()
    assert diff > 0.1  # the same tokens, other keys: RoPE rotates them by another base

    file_fp = model_fingerprint(llama_path).digest
    by_config = model_fingerprint(ModelIdentity(str(llama_path), model_config=OVERRIDE)).digest
    by_object = model_fingerprint(llama_path, model_object=overridden).digest
    assert by_config != file_fp
    # the loaded model's own arguments count, so an override the app did not name still counts,
    # and it agrees with a daemon that was told the override
    assert by_object == by_config
    assert model_fingerprint(llama_path, model_object=plain).digest == file_fp
    # an "override" equal to the file's value, or none at all, is the file's config
    assert (
        model_fingerprint(
            ModelIdentity(str(llama_path), model_config={"rope_theta": 10000.0})
        ).digest
        == file_fp
    )
    assert model_fingerprint(ModelIdentity(str(llama_path), model_config={})).digest == file_fp


def test_hydrate_does_not_serve_the_file_config_entry_to_an_overridden_model(
    llama_path, kv_home, tmp_path
):
    with Store(kv_home) as store:
        warm(load_manifest(manifest_for(tmp_path, llama_path, PIN)), store, home=kv_home)
        assert len(store.metas()) == 1
    overridden, _ = load(str(llama_path), model_config=OVERRIDE)
    for kw in ({"model": overridden}, {"model": overridden, "model_config": OVERRIDE}, {
        "model_config": OVERRIDE
    }):  # fmt: skip
        lru = LRUPromptCache()
        report = hydrate(lru, "m", llama_path, home=kv_home, **kw)
        assert report.entries == 0 and len(lru) == 0, kw
        assert report.warning and "another version" in report.warning


def test_a_manifest_model_config_warms_what_the_overridden_app_hydrates(
    llama_path, kv_home, tmp_path
):
    path = manifest_for(tmp_path, llama_path, PIN, extra="model_config = { rope_theta = 1e6 }")
    manifest = load_manifest(path)
    assert manifest.models[0].identity.model_config == OVERRIDE
    with Store(kv_home) as store:
        report = warm(manifest, store, home=kv_home)
        assert report.warmed == 1
        (meta,) = store.metas()
        assert meta.extra.model_config == OVERRIDE
    overridden, _ = load(str(llama_path), model_config=OVERRIDE)
    lru = LRUPromptCache()
    report = hydrate(lru, "m", llama_path, home=kv_home, model=overridden)
    assert report.entries == 1, report
    tokens = meta.token_ids()
    cache, rest = lru.fetch_nearest_cache("m", tokens + [5])
    assert rest == [5]
    assert_same_kv(cache, prefill(overridden, tokens))
    # and the plain model gets nothing of it
    plain_report = hydrate(LRUPromptCache(), "m", llama_path, home=kv_home)
    assert plain_report.entries == 0


def test_a_manifest_edit_of_model_config_purges_the_old_pins(llama_path, kv_home, tmp_path):
    path = manifest_for(tmp_path, llama_path, PIN)
    with Store(kv_home) as store:
        warm(load_manifest(path), store, home=kv_home)
        edited = path.read_text().replace("\n\n", "\nmodel_config = { rope_theta = 1e6 }\n", 1)
        path.write_text(edited)
        report = warm(load_manifest(path), store, home=kv_home)
        assert [p.cause for p in report.purged] == ["model removed from the manifest"]
        assert report.warmed == 1
        (meta,) = store.metas()
        assert (
            meta.fingerprint
            == model_fingerprint(ModelIdentity(str(llama_path), model_config=OVERRIDE)).digest
        )


def test_serve_gives_model_config_to_the_served_models_load_only(llama_path, kv_home):
    from unittest import mock

    from mlx_lm import server

    from kvstore.client.serve.hooks import ServeError, patched_server

    seen = []

    def fake_load(path, *a, **kw):
        seen.append((path, kw.get("model_config")))
        raise RuntimeError("stop here")

    with mock.patch.object(server, "load", fake_load):
        with patched_server(kv_home, model_config=OVERRIDE) as srv:
            provider = srv.ModelProvider.__new__(srv.ModelProvider)
            provider.is_distributed = False
            provider.reset = lambda: None
            provider.cli_args = mock.Mock(trust_remote_code=False)
            provider._tokenizer_config = {}
            with pytest.raises(ServeError, match="stop here"):  # a load failure names its cause
                provider._load(str(llama_path))
            assert server.load is fake_load  # restored after the load
    assert seen == [(str(llama_path), OVERRIDE)]
