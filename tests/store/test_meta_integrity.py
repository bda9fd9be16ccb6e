"""Meta integrity (issue 10 item 5): LMDB keeps no page checksums, so a flipped byte in a meta
record must be caught by the record's own checksum and by the tokens-hash-to-key check, on every
read path (get_meta, load, the metas scan hydrate uses, verify), and never be served as a hit."""

from __future__ import annotations

import msgpack
import pytest
from helpers import cli
from mlx_lm.models.cache import LRUPromptCache

from kvstore.client import hydrate
from kvstore.errors import CorruptEntryError, StoreError
from kvstore.store.entry import EntryMeta, entry_key, pack_tokens
from kvstore.store.store import Store


def _raw_meta(home, key: bytes) -> bytes:
    with Store(home) as store, store.env.begin() as txn:
        return bytes(txn.get(key, db=store._meta))


def _raw_write(home, key: bytes, raw: bytes) -> None:
    """What a torn page or a bit rot does: bytes changed behind the store's back."""
    with Store(home) as store, store.env.begin(write=True) as txn:
        txn.put(key, raw, db=store._meta)


def _flip(raw: bytes, needle: bytes, at: int = 0) -> bytes:
    """Flip one bit inside the first occurrence of `needle` (a field's bytes) in the record."""
    i = raw.find(needle)
    assert i >= 0, "field bytes not found in the stored record"
    b = bytearray(raw)
    b[i + at] ^= 0x01
    return bytes(b)


def _assert_refused_everywhere(home, llama_path, bad: EntryMeta, good: EntryMeta) -> None:
    with Store(home) as store:
        with pytest.raises(CorruptEntryError, match=bad.key.hex()):
            store.get_meta(bad.key)
        with pytest.raises(CorruptEntryError, match=bad.key.hex()):
            store.load(bad.key)
        errors: list = []
        assert [m.key for m in store.metas(errors=errors)] == [good.key]
        assert [e.key for e in errors] == [bad.key]
    lru = LRUPromptCache()
    report = hydrate(lru, "m", llama_path, home=home)
    assert report.labels == [good.label]  # the damaged pin is never inserted
    assert any(bad.key.hex() in s for s in report.skipped)
    result = cli("verify", "--home", home)
    assert result.exit_code == 1 and f"bad entry {bad.key.hex()}" in result.output
    assert good.key.hex() not in result.output


def test_a_flipped_token_byte_in_a_stored_meta_is_refused_not_served(warmed, kv_home, llama_path):
    """The tokens are what a hit is compared against: a changed token id would serve this KV for
    a prefix it was never computed for."""
    bad, good = warmed["classify"], warmed["synthesize"]
    _raw_write(kv_home, bad.key, _flip(_raw_meta(kv_home, bad.key), bad.tokens, at=40))
    _assert_refused_everywhere(kv_home, llama_path, bad, good)


def test_a_flipped_byte_in_another_meta_field_is_refused(warmed, kv_home, llama_path):
    """The label (what a stage's hit is counted under) is covered by the record's own checksum."""
    bad, good = warmed["classify"], warmed["synthesize"]
    _raw_write(kv_home, bad.key, _flip(_raw_meta(kv_home, bad.key), b"classify", at=2))
    _assert_refused_everywhere(kv_home, llama_path, bad, good)
    with Store(kv_home) as store:
        with pytest.raises(CorruptEntryError, match="checksum"):
            store.get_meta(bad.key)


def _legacy_record(meta: EntryMeta) -> bytes:
    """A schema-1 record, as stores written before the checksum hold them."""
    from dataclasses import asdict

    d = asdict(meta)
    d.pop("key")
    d["v"] = 1
    return msgpack.packb(d, use_bin_type=True)


def test_schema_1_records_are_still_read_and_re_checked(kv_home):
    tokens = [11, 12, 13]
    key = entry_key(b"\x07" * 16, tokens)
    with Store(kv_home) as store:
        meta = store.put(key, bytes(64), tokens=pack_tokens(tokens), label="old")
    _raw_write(kv_home, key, _legacy_record(meta))
    with Store(kv_home) as store:
        assert store.get_meta(key).label == "old"
        store.touch([key])  # a rewrite upgrades the record to schema 2
    assert msgpack.unpackb(_raw_meta(kv_home, key))["v"] == 2

    # Without a checksum, the token hash still catches a changed token id.
    _raw_write(kv_home, key, _flip(_legacy_record(meta), meta.tokens, at=4))
    with Store(kv_home) as store, pytest.raises(CorruptEntryError, match="hash to its key"):
        store.get_meta(key)


def test_a_put_whose_key_does_not_hash_its_tokens_is_refused(kv_home):
    with Store(kv_home) as store:
        with pytest.raises(StoreError, match="does not match the entry's tokens"):
            store.put(b"\x01" * 32, bytes(8), tokens=pack_tokens([1, 2]))
        assert store.keys() == []


def test_a_stored_extra_that_is_not_a_map_is_named_as_a_dict():
    """`verify` and `ls` name the stored shape (a map: `dict`), not the type it is read into."""
    from dataclasses import replace

    from kvstore.store.entry import EntryExtra

    tokens = [1, 2, 3]
    meta = EntryMeta(entry_key(b"\x01" * 16, tokens), pack_tokens(tokens), 3, "x", False, "/m",
                     b"\x01" * 16, b"\0" * 16, 0.0, 0.0, 0, 0, 0, 1, [], EntryExtra())  # fmt: skip
    assert meta.type_error() is None
    assert replace(meta, extra=[1]).type_error() == "field 'extra' must be dict"
