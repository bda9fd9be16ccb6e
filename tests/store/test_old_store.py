"""A store main wrote at 3ccb923 (tests/fixtures/store_3ccb923, made by
tests/fixtures/make_3ccb923_store.py) reads with today's code: every stored extra key is the named
field of EntryExtra holding what was written (a dropped or renamed field fails here), a newer
writer's key survives, records re-pack to the stored bytes, and `kvstore ls` and `verify` pass."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import lmdb
import msgpack
from helpers import cli

from kvstore.learned.blockstore import BlockMeta, BlockStore
from kvstore.store.entry import EntryMeta, unchecked
from kvstore.store.store import Store

FIXTURE = Path(__file__).parent.parent / "fixtures" / "store_3ccb923"
NEWER = "a_newer_writers_key"  # a key no field names: kept as stored


def stored(home: Path, db: bytes) -> dict[bytes, bytes]:
    """key -> the record's bytes as stored, read with lmdb alone."""
    env = lmdb.open(str(home / "store"), readonly=True, lock=False, max_dbs=32, subdir=True)
    try:
        with env.begin() as txn:
            return {bytes(k): bytes(v) for k, v in txn.cursor(db=env.open_db(db, txn=txn))}
    finally:
        env.close()


def body(raw: bytes) -> dict:
    return msgpack.unpackb(msgpack.unpackb(raw)["body"], raw=False)


def home_copy(kv_home: Path) -> Path:
    shutil.copytree(FIXTURE, kv_home)
    return kv_home


def test_every_stored_extra_key_reads_as_its_field_and_repacks_to_the_same_bytes(kv_home):
    home = home_copy(kv_home)
    entries, records = stored(home, b"meta"), stored(home, b"bmeta")
    assert len(entries) == 3 and len(records) == 1
    for key, raw in entries.items():
        meta, extra = EntryMeta.unpack(key, raw), body(raw)["extra"]
        for name, value in extra.items():
            if name != NEWER:
                assert getattr(meta.extra, name) == value, name
        assert list(meta.extra.to_map().items()) == list(extra.items())
        assert meta.pack() == raw  # a read-modify-write changes no stored byte
    for key, raw in records.items():
        record, extra = BlockMeta.unpack(key, raw), body(raw)["extra"]
        for name, value in extra.items():
            assert getattr(record.extra, name) == value, name
        assert record.pack() == raw
    with Store(home, readonly=True) as store:
        metas = {m.label: m for m in store.metas()}
        chat, every = metas["chat"].extra, metas["every-key"].extra
        assert chat.chat_template_kwargs == {"terse": True} and chat.source == "manifest"
        assert (chat.kv_group_size, chat.quantized_kv_start, chat.adapter) == (64, 5000, None)
        assert metas["chat"].extra.owners == [f"manifest:{chat.manifest}"]
        assert every.trusted and every.checked is False and every.check == "all 9 positions"
        assert (every.origin, every.uploader, every.valid_date) == ("remote", "box-a", "2026-03-14")
        assert unchecked(metas["every-key"]) and every.pinned_before_manifests is False
        assert every.to_map()[NEWER] == {"kept": [1, 2]}
        edited = metas["every-key"].extra.updated(uploader="box-b").to_map()
        assert edited[NEWER] == {"kept": [1, 2]} and list(edited)[-1] == NEWER
        (record,) = BlockStore(store).records()
        assert (record.extra.origin, record.extra.uploader) == ("remote", "box-a")
        assert record.extra.model == chat.model_dir


def test_ls_and_verify_pass_on_the_old_store(kv_home):
    home_copy(kv_home)
    listed = {e["label"]: e for e in json.loads(cli("ls", "--json", code=0).output)}
    assert sorted(listed) == ["chat", "every-key", "text"]
    assert listed["every-key"][NEWER] == {"kept": [1, 2]}  # extra's keys, as ls --json showed
    assert listed["chat"]["chat_template_kwargs"] == {"terse": True}
    assert "1 learned record" in cli("ls", "--learned", code=0).output
    cli("verify", code=0)


def test_every_field_reads_its_own_key_and_a_wrong_type_is_kept_as_stored():
    from kvstore.store.entry import _EXTRA_TYPES, EntryExtra

    stored = {**{name: kinds[0]() for name, kinds in _EXTRA_TYPES.items()}, "kv_bits": "8", "z": 1}
    extra = EntryExtra.from_map(stored)
    assert all(getattr(extra, k) == v for k, v in stored.items() if k not in ("kv_bits", "z"))
    assert extra.kv_bits is None and list(extra.to_map().items()) == list(stored.items())
