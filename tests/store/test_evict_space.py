"""After a full disk, an evict makes room (issue 43 item 4): on a real small filesystem that a
store filled, `kvstore evict --label` frees an entry's pages and the next write of that size is
stored at its first try (LMDB gives a write only the pages freed before the last commit, so the
store ages them with one small commit when a write fails for space), and the evict's tombstone,
which finds no room, leaves no temporary file behind."""

from __future__ import annotations

import os

import pytest
from full_disk import mounted_tmpfs
from helpers import cli

from kvstore.errors import StoreError
from kvstore.store.entry import entry_key, pack_tokens
from kvstore.store.store import Store

pytestmark = pytest.mark.slow

FP = b"\x43" * 16
SIZE = 700 * 1024  # four of them fill the 3 MiB filesystem


def _put(store: Store, i: int) -> None:
    tokens = [i, 43]
    store.put(entry_key(FP, tokens), os.urandom(SIZE), tokens=pack_tokens(tokens), label=f"big{i}")


def test_the_space_an_evict_frees_serves_the_next_write_of_that_size(tmp_path, kv_home):
    with mounted_tmpfs(tmp_path / "fs", "3m") as mnt:
        home = mnt / "home"
        with Store(home) as store:
            stored = 0
            with pytest.raises(StoreError, match="write failed") as full:  # the disk fills up
                for i in range(10):
                    _put(store, i)
                    stored += 1
            assert stored >= 2
            assert "or `kvstore evict` entries: the next write reuses" in str(full.value)
        result = cli("evict", "--label", "big1", "--home", home, code=0)
        assert "1" in result.output, result.output
        with Store(home) as store:
            _put(store, 1)  # the first try: no "disk full"
            assert {m.label for m in store.metas()} == {f"big{i}" for i in range(stored)}
        temps = [p.name for p in home.iterdir() if p.suffix == ".tmp" or p.name.startswith(".")]
        assert not temps, temps  # no temporary tombstones file left behind
