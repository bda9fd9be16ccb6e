"""Fixtures of the store tests (LMDB entries, their integrity, who owns them)."""

from __future__ import annotations

import pytest
from helpers import TWO_PINS, manifest_for

from kvstore.ops.warm import warm
from kvstore.pins.manifest import load_manifest
from kvstore.store.entry import EntryMeta
from kvstore.store.store import Store


@pytest.fixture
def warmed(llama_path, kv_home, tmp_path) -> dict[str, EntryMeta]:
    """The two pins of TWO_PINS warmed into this test's home: their metadata by label."""
    manifest = load_manifest(manifest_for(tmp_path, llama_path, TWO_PINS))
    with Store(kv_home) as store:
        warm(manifest, store, home=kv_home)
        return {m.label: m for m in store.metas()}
