"""The LMDB store: range scans by fingerprint, map growth, idempotent puts, collisions."""

from __future__ import annotations

from unittest import mock

import lmdb
import pytest
from helpers import TWO_PINS, manifest_for
from mlx_lm.models.cache import LRUPromptCache

from kvstore.client import hydrate
from kvstore.codec import codec
from kvstore.errors import StoreError
from kvstore.ops.warm import warm
from kvstore.pins.manifest import load_manifest
from kvstore.store.entry import entry_key, pack_tokens
from kvstore.store.store import Store


def _put(store, fp: bytes, tokens: list[int], size: int = 64, **kw):
    return store.put(entry_key(fp, tokens), bytes(size), tokens=pack_tokens(tokens), **kw)


def test_range_scan_returns_one_models_entries(kv_home):
    a, b = b"\x01" * 16, b"\x02" * 16
    with Store(kv_home) as store:
        for i in range(5):
            _put(store, a, [i, 1, 2], label=f"a{i}")
            _put(store, b, [i, 7], label=f"b{i}")
        assert {m.label for m in store.metas(a)} == {f"a{i}" for i in range(5)}
        assert {m.label for m in store.metas(b)} == {f"b{i}" for i in range(5)}
        assert len(store.metas()) == 10
        assert store.metas(b"\x03" * 16) == []


def test_put_is_idempotent_and_keeps_created(kv_home):
    fp = b"\x05" * 16
    with Store(kv_home) as store:
        first = _put(store, fp, [1, 2, 3], pinned=True)
        store.touch([first.key])
        again = _put(store, fp, [1, 2, 3], pinned=True)
        assert again.created == first.created and again.hits == 1
        changed = store.put(first.key, b"\x01" * 64, tokens=pack_tokens([1, 2, 3]))
        assert changed.created >= first.created and changed.hits == 0


def test_map_grows_by_doubling(kv_home):
    with Store(kv_home, map_size=2**20) as store:
        for i in range(12):  # 12 MiB into a 1 MiB map
            _put(store, b"\x07" * 16, [i], size=2**20)
        assert store.env.info()["map_size"] >= 16 * 2**20
        assert len(store.metas()) == 12


def test_map_growth_cap_is_a_clear_error(kv_home):
    with Store(kv_home, map_size=2**20, max_map_size=2**21) as store:
        with pytest.raises(StoreError, match="max_map_size"):
            for i in range(8):
                _put(store, b"\x07" * 16, [i], size=2**20)
        assert len(store.metas()) >= 1  # what was committed is still there


READER = """
import sys
from kvstore.store.store import Store
store = Store(sys.argv[1], readonly=True)
print(len(store.metas()), flush=True)
sys.stdin.readline()
print(len(store.metas()), flush=True)
"""


def test_reader_survives_writer_growing_the_map(kv_home):
    """Another process's reader adopts the map the writer doubled (MapResizedError)."""
    import subprocess
    import sys

    with Store(kv_home, map_size=2**20) as writer:
        _put(writer, b"\x08" * 16, [0])
        child = subprocess.Popen(
            [sys.executable, "-c", READER, str(kv_home)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout.readline().strip() == "1"
        for i in range(1, 10):
            _put(writer, b"\x08" * 16, [i], size=2**20)
        assert writer.env.info()["map_size"] > 2**20
        out, _ = child.communicate("go\n", timeout=60)
    assert child.returncode == 0 and out.strip() == "10"


GROWER = """
import sys
from kvstore.store.entry import entry_key, pack_tokens
from kvstore.store.store import Store
with Store(sys.argv[1], map_size=2**20) as store:
    for i in range(1, 10):
        tokens = [i]
        store.put(entry_key(b"\\x09" * 16, tokens), bytes(2**20), tokens=pack_tokens(tokens))
    print(store.env.info()["map_size"], flush=True)
"""


def test_writer_survives_another_process_growing_the_map(kv_home):
    """Issue 10 item 9: a write after another process doubled the map adopts the new size
    (MapResizedError on the write path), instead of failing as "disk full?"."""
    import subprocess
    import sys

    with Store(kv_home, map_size=2**20) as parent:
        _put(parent, b"\x09" * 16, [0])  # the parent's environment is open at 1 MiB
        child = subprocess.run(
            [sys.executable, "-c", GROWER, str(kv_home)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert child.returncode == 0, child.stderr
        assert int(child.stdout) > 2**20, "the child should have grown the map"
        written = _put(parent, b"\x09" * 16, [100], size=2**20)  # a write, before any read
        assert parent.get_meta(written.key) is not None
        assert len(parent.metas()) == 11
        assert parent.env.info()["map_size"] >= int(child.stdout)


def test_a_store_opened_after_another_process_grew_the_map(kv_home):
    """Opening a Store begins a transaction (its databases' handles). On an environment this
    process opened before another process grew the map, that transaction meets
    MapResizedError: the open adopts the new size, as reads and writes do (it was an error, and
    in a fresh environment a race that an open beside a growing writer could lose)."""
    import subprocess
    import sys

    with Store(kv_home, map_size=2**20) as first:
        _put(first, b"\x09" * 16, [0])
        child = subprocess.run(
            [sys.executable, "-c", GROWER, str(kv_home)], capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        assert child.returncode == 0, child.stderr
        with Store(kv_home, readonly=True) as second:  # the same environment, still at 1 MiB
            assert second.env is first.env
            assert len(second.metas()) == 10


def test_stores_of_one_path_share_the_environment(kv_home):
    with Store(kv_home) as writer:
        _put(writer, b"\x08" * 16, [0])
        with Store(kv_home, readonly=True) as reader:
            assert reader.env is writer.env and len(reader.metas()) == 1
        assert len(writer.metas()) == 1  # the reader's close left the writer's env open


def test_readonly_open_of_missing_store_is_clear(tmp_path):
    with pytest.raises(StoreError, match="no store here"):
        Store(tmp_path, readonly=True)


def test_store_refuses_use_after_fork(kv_home):
    with Store(kv_home) as store:
        store._pid = -1
        with pytest.raises(StoreError, match="fork"):
            store.metas()


def test_forced_collision_never_serves_wrong_kv(llama_path, kv_home, tmp_path):
    """With the prefix hash forced to a constant every pin shares one key: no wrong hit."""
    manifest = load_manifest(manifest_for(tmp_path, llama_path, TWO_PINS))
    with mock.patch("kvstore.store.entry.packed_prefix_hash", return_value=b"\x00" * 16):
        with Store(kv_home) as store:
            warm(manifest, store, home=kv_home)
            (meta,) = store.metas()  # the second pin overwrote the first under the same key
            other = [p for p in manifest.models[0].prefixes if p.name != meta.label][0]
            from mlx_lm.utils import load_tokenizer

            from kvstore.pins.render import render_prefix

            other_tokens = render_prefix(load_tokenizer(llama_path), other).tokens
            with pytest.raises(KeyError):
                store.load(meta.key, pack_tokens(other_tokens))
            _, cache = store.load(meta.key, meta.tokens)
        lru = LRUPromptCache()
        hydrate(lru, "m", llama_path, home=kv_home)
        got, rest = lru.fetch_nearest_cache("m", list(other_tokens))
        # whatever is served for the other prefix covers only tokens it really shares
        shared = 0
        for x, y in zip(meta.token_ids(), other_tokens):
            if x != y:
                break
            shared += 1
        assert len(other_tokens) - len(rest) <= shared
        assert codec.cache_classes(cache) == ["KVCache", "KVCache"]


def test_check_reports_blob_without_meta(kv_home):
    with Store(kv_home) as store:
        m = _put(store, b"\x09" * 16, [1])
        with store.env.begin(write=True) as txn:
            txn.delete(m.key, db=store._meta)
        problems = store.check()
        assert [p.key for p in problems] == [m.key] and "without meta" in problems[0].reason
        from kvstore.learned.blockstore import BlockStore
        from kvstore.ops import verify

        verify.check(store, BlockStore(store), home=kv_home, repair=True)
        assert store.check() == []


def test_lmdb_settings(kv_home):
    with Store(kv_home) as store:
        flags = store.env.flags()
        assert flags["writemap"] is False and flags["sync"] is True
        assert isinstance(store.env, lmdb.Environment)


def test_map_growth_waits_for_this_process_readers(kv_home):
    """set_mapsize needs no open transaction in the process: reads on other threads (the
    daemon's connection threads) hold the gate, so growth waits for them (without it, this
    hangs in py-lmdb's abort of the write that hit MapFullError)."""
    import threading

    from kvstore.store.lmdbenv import Gate as _Gate

    errors: list[BaseException] = []
    stop = threading.Event()
    with Store(kv_home, map_size=2**20) as store:
        _put(store, b"\x0a" * 16, [0])

        def read_forever():
            try:
                while not stop.is_set():
                    for m in store.metas():
                        assert store.read_blob(m.key) == bytes(m.nbytes)
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)

        readers = [threading.Thread(target=read_forever) for _ in range(3)]
        for t in readers:
            t.start()
        try:
            sizes = set()
            with mock.patch.object(_Gate, "exclusive", wraps=store._gate.exclusive) as gate:
                for i in range(1, 24):
                    _put(store, b"\x0a" * 16, [i], size=2**20)
                    sizes.add(store.env.info()["map_size"])
        finally:
            stop.set()
            for t in readers:
                t.join()
        assert gate.call_count == 23 and len(sizes) >= 4  # the map doubled under the readers
        assert not errors, errors
        assert len(store.metas()) == 24


def test_put_refuses_fields_of_the_wrong_type(kv_home):
    with Store(kv_home) as store:
        for bad, field in (
            (dict(label=7), "label"),
            (dict(extra="x"), "extra"),
            (dict(pinned="yes"), "pinned"),
            (dict(classes=[1]), "classes"),
            (dict(extra={1: "x"}), "extra"),
        ):
            with pytest.raises(StoreError, match=field):
                _put(store, b"\x0b" * 16, [1], **bad)
        assert store.metas() == []


def test_a_poisoned_meta_is_one_bad_entry_not_a_broken_store(kv_home):
    import msgpack

    from kvstore.errors import CorruptEntryError
    from kvstore.store.entry import seal

    with Store(kv_home) as store:
        good = _put(store, b"\x0c" * 16, [1], label="good", extra={"key": "shadow"})
        bad = _put(store, b"\x0c" * 16, [2], label="bad")
        record = msgpack.unpackb(store.env.begin().get(bad.key, db=store._meta), raw=False)
        raw = msgpack.unpackb(record["body"], raw=False)
        raw["label"], raw["extra"] = 7, "x"
        with store.env.begin(write=True) as txn:  # re-sealed: the type check must catch it
            txn.put(bad.key, seal(msgpack.packb(raw, use_bin_type=True)), db=store._meta)
        errors: list = []
        metas = store.metas(errors=errors)
        assert [m.label for m in metas] == ["good"]
        assert isinstance(errors[0], CorruptEntryError) and "label" in errors[0].reason
        assert metas[0].to_json()["key"] == good.key.hex()  # extra can never shadow a field


def test_a_forked_child_never_reuses_the_parents_environment(kv_home):
    """py-lmdb refuses a second open of a path inside one process, and a forked child counts as
    the parent: the child gets a clear StoreError, never the parent's environment object."""
    import os

    with Store(kv_home) as parent:
        _put(parent, b"\x0d" * 16, [1])
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = b"?"
            try:
                child = Store(kv_home, readonly=True)
                code = b"R" if child.env is parent.env else b"N"
            except StoreError as e:
                code = b"E" if "already open" in str(e) else b"?"
            finally:
                os.write(w, code)
                os._exit(0)
        os.close(w)
        os.waitpid(pid, 0)
        assert os.read(r, 1) in (b"E", b"N")  # an error or a fresh environment, never reuse
