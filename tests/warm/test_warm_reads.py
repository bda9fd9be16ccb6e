"""A model's directory, config and template hash are read once per warm (issue 35, item 1): the
plan reads them into the model's located identity and every later step takes them from it."""

from __future__ import annotations

import sys
from collections import Counter

from helpers import TWO_PINS, manifest_for

from kvstore.ops import warm as warm_ops
from kvstore.pins.manifest import load_manifest
from kvstore.store.store import Store

# what reads a model's directory, its config and its template files (the last two by the
# directory's template files: template_digest; template_hash is the same read for a path)
READERS = {
    "directory": [("kvstore.identity.fingerprint", "resolve_model_path")],
    "config": [("kvstore.identity.modelconfig", "effective_config")],
    "template": [
        ("kvstore.identity.modelconfig", "template_digest"),
        ("kvstore.identity.fingerprint", "template_hash"),
    ],
}


def count_reads(monkeypatch) -> Counter:
    """Count each read through a wrapper put wherever a kvstore module holds the real function."""
    counts: Counter = Counter()
    depth: Counter = Counter()  # template_hash -> template_digest is one read, not two
    modules = [m for n, m in list(sys.modules.items()) if n.startswith("kvstore") and m]
    for what, readers in READERS.items():
        for module, name in readers:
            real = getattr(sys.modules[module], name, None)
            if real is None:  # not in this version
                continue

            def counted(*args, __real=real, __what=what, **kw):
                counts[__what] += depth[__what] == 0
                depth[__what] += 1
                try:
                    return __real(*args, **kw)
                finally:
                    depth[__what] -= 1

            for m in modules:
                if getattr(m, name, None) is real:
                    monkeypatch.setattr(m, name, counted)
    return counts


def test_one_warm_reads_the_models_directory_config_and_template_once(
    llama_path, kv_home, tmp_path, monkeypatch
):
    manifest = load_manifest(manifest_for(tmp_path, llama_path, TWO_PINS))
    with Store(kv_home) as store:
        counts = count_reads(monkeypatch)
        report = warm_ops.warm(
            manifest, store, home=kv_home, progress=lambda m: None, warn=lambda m: None
        )
        assert sorted(p.status for p in report.pins) == ["warmed", "warmed"]
        print("reads in one warm of a two-pin manifest:", dict(counts))
        assert dict(counts) == {"directory": 1, "config": 1, "template": 1}
        # the entries still record where the model resolved and its template hash
        from kvstore.identity.fingerprint import resolve_model_path, template_hash

        for meta in store.metas():
            assert meta.extra.model_dir == str(resolve_model_path(llama_path))
            assert meta.template_hash == template_hash(llama_path)


def test_two_models_are_each_read_once(llama_path, sliding_path, kv_home, tmp_path, monkeypatch):
    path = tmp_path / "manifest.toml"
    tables = [f'[[model]]\npath = "{m}"\n{TWO_PINS}' for m in (llama_path, sliding_path)]
    path.write_text("\n".join(tables))
    manifest = load_manifest(path)
    with Store(kv_home) as store:
        counts = count_reads(monkeypatch)
        report = warm_ops.warm(
            manifest, store, home=kv_home, progress=lambda m: None, warn=lambda m: None
        )
        assert [p.status for p in report.pins] == ["warmed"] * 4
        assert dict(counts) == {"directory": 2, "config": 2, "template": 2}
