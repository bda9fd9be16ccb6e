"""Issue 10 item 11: entries have owners (manifests, the app); a manifest purges by owner.

Before: a manifest pin whose tokens an app (here `kvstore serve`'s system prefix, unpinned) had
stored was "present" but never the manifest's: it stayed unpinned (the budget could evict a
manifest pin), and a manifest edit never touched it.
"""

from __future__ import annotations

from helpers import CLASSIFY, SYNTHESIZE, TWO_PINS, manifest_for
from mlx_lm import load

from kvstore.codec import codec
from kvstore.identity.fingerprint import model_fingerprint, template_hash
from kvstore.kvcheck.prefill import prefill
from kvstore.ops.evictable import select_for_eviction
from kvstore.ops.warm import warm
from kvstore.pins.manifest import load_manifest
from kvstore.pins.ownership import manifest_owner, owners
from kvstore.pins.render import render_prefix
from kvstore.store.entry import entry_key, pack_tokens
from kvstore.store.store import Store


def store_as_app(store, model_path, prefix, *, pinned: bool) -> bytes:
    """What `kvstore serve --persist-system-prompts` stores for a system prompt it saw."""
    model, tokenizer = load(str(model_path))
    tokens = render_prefix(tokenizer, prefix).tokens
    key = entry_key(model_fingerprint(model_path).digest, tokens)
    cache = prefill(model, tokens)
    store.put(
        key,
        codec.encode(cache, {"model": str(model_path), "tokenizer_config": "{}"}),
        tokens=pack_tokens(tokens),
        label="system",
        pinned=pinned,
        model=str(model_path),
        template_hash=template_hash(model_path),
        classes=codec.cache_classes(cache),
        extra={"adapter": None, "kv_bits": None, "source": "serve"},
    )
    return key


def test_a_manifest_owns_what_an_app_stored_and_releases_it_on_edit(llama_path, kv_home, tmp_path):
    path = manifest_for(tmp_path, llama_path, TWO_PINS)
    manifest = load_manifest(path)
    me = manifest_owner(manifest.path)
    with Store(kv_home) as store:
        app_key = store_as_app(store, llama_path, manifest.models[0].prefixes[0], pinned=False)
        report = warm(manifest, store, home=kv_home)
        assert {p.name: p.status for p in report.pins} == {
            "classify": "present", "synthesize": "warmed"
        }  # fmt: skip
        assert report.adopted == 1
        meta = store.get_meta(app_key)
        assert owners(meta) == ["app", me] and meta.pinned  # a manifest pin is never evicted
        assert app_key not in {m.key for m in select_for_eviction(
            store.metas(), to_size=0, home=kv_home)}  # fmt: skip
        synth_key = next(m.key for m in store.metas() if m.label == "synthesize")
        assert owners(store.get_meta(synth_key)) == [me]

        # the edit drops both pins: the manifest-only one goes, the app's stays as it was
        path.write_text(
            path.read_text().replace(CLASSIFY, "You route.").replace(SYNTHESIZE, "You write.")
        )
        report = warm(load_manifest(path), store, home=kv_home)
        assert [p.key for p in report.purged] == [synth_key.hex()]
        assert [p.key for p in report.released] == [app_key.hex()]
        meta = store.get_meta(app_key)
        assert meta is not None and owners(meta) == ["app"] and not meta.pinned
        assert store.get_meta(synth_key) is None
        assert store.check() == []


def test_a_pinned_app_entry_stays_pinned_after_the_manifest_lets_go(llama_path, kv_home, tmp_path):
    path = manifest_for(tmp_path, llama_path, TWO_PINS)
    manifest = load_manifest(path)
    with Store(kv_home) as store:
        key = store_as_app(store, llama_path, manifest.models[0].prefixes[0], pinned=True)
        warm(manifest, store, home=kv_home)
        path.write_text(path.read_text().replace(CLASSIFY, "You route."))
        warm(load_manifest(path), store, home=kv_home)
        meta = store.get_meta(key)
        assert meta.pinned and owners(meta) == ["app"]


def test_two_manifests_share_an_entry_until_both_let_go(llama_path, kv_home, tmp_path):
    a = manifest_for(tmp_path, llama_path, TWO_PINS, name="a.toml")
    b = manifest_for(tmp_path, llama_path, TWO_PINS, name="b.toml")
    with Store(kv_home) as store:
        warm(load_manifest(a), store, home=kv_home)
        assert warm(load_manifest(b), store, home=kv_home).adopted == 2
        a.write_text(a.read_text().replace(CLASSIFY, "You route."))
        report = warm(load_manifest(a), store, home=kv_home)
        assert [p.label for p in report.released] == ["classify"] and report.purged == []
        b.write_text(b.read_text().replace(CLASSIFY, "You route."))
        report = warm(load_manifest(b), store, home=kv_home)
        assert [p.label for p in report.purged] == ["classify"]
        assert sorted(m.label for m in store.metas()) == ["classify", "synthesize"]  # new ones
