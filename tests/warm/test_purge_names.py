"""A purge names each entry by the key `kvstore ls` shows, in the log and in warm's output."""

from __future__ import annotations

import logging

from helpers import cli, manifest_for

from kvstore.ops.warm import warm
from kvstore.pins.manifest import load_manifest
from kvstore.store.store import Store


def _pins(*texts: str) -> str:
    return "".join(f'[[model.prefix]]\nname = "p{i}"\ntext = "{t}"\n' for i, t in enumerate(texts))


def test_purged_entries_are_named_by_their_ls_key(tmp_path, llama_path, kv_home, caplog):
    manifest = manifest_for(tmp_path, llama_path, _pins("first prompt", "second prompt"))
    with Store(kv_home) as store:
        warm(load_manifest(manifest), store, home=kv_home)
        before = {m.label: m.key.hex() for m in store.metas()}
    manifest_for(tmp_path, llama_path, _pins("first prompt, edited", "second prompt, edited"))
    with caplog.at_level(logging.INFO, logger="kvstore"), Store(kv_home) as store:
        report = warm(load_manifest(manifest), store, home=kv_home)
    assert {p.label for p in report.purged} == {"p0", "p1"}
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("purged ")]
    assert len(lines) == 2, lines
    for label, key in before.items():
        shown = key[32:44]  # what `kvstore ls` shows in its KEY column
        assert any(f"purged {shown} pin {label!r}" in ln for ln in lines), lines
    fingerprint = next(iter(before.values()))[:12]  # the same for both: names neither
    assert not any(fingerprint in ln for ln in lines), lines


def test_warm_prints_purges_by_their_ls_key(tmp_path, llama_path, kv_home):
    manifest = manifest_for(tmp_path, llama_path, _pins("one prompt"))
    cli("warm", "--manifest", manifest, code=0)
    (old,) = [ln.split()[0] for ln in cli("ls", code=0).output.splitlines()[1:-1]]
    manifest_for(tmp_path, llama_path, _pins("one prompt, edited"))
    out = cli("warm", "--manifest", manifest, code=0).output
    (purged,) = [ln for ln in out.splitlines() if ln.startswith("purged")]
    assert purged.split()[2] == old, out


def test_a_purge_is_an_eviction_that_leaves_no_tombstone(tmp_path, llama_path, kv_home, caplog):
    """A purged pin leaves the store through the one eviction (its metric and log line), but no
    tombstone: a request for it is explained by what the manifest holds now."""
    from kvstore import metrics
    from kvstore.home import tombstones

    manifest = manifest_for(tmp_path, llama_path, _pins("first prompt"))
    with Store(kv_home) as store:
        warm(load_manifest(manifest), store, home=kv_home)
        (old,) = store.metas()
    manifest_for(tmp_path, llama_path, _pins("first prompt, edited"))
    before = metrics.REGISTRY.get_sample_value("kvstore_evictions_total", {"reason": "stale_pin"})
    with caplog.at_level(logging.INFO, logger="kvstore"), Store(kv_home) as store:
        warm(load_manifest(manifest), store, home=kv_home)
        assert old.key not in {m.key for m in store.metas()}
    after = metrics.REGISTRY.get_sample_value("kvstore_evictions_total", {"reason": "stale_pin"})
    assert after - (before or 0) == 1
    assert tombstones.load(kv_home, old.model) == []
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("evicted ")]
    assert any(old.key.hex() in ln and "a stale pin of" in ln for ln in lines), lines
