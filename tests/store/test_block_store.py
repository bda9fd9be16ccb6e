"""Learned block records in their own DBs: shared starts stored once, lookup walks and trims,
corruption ends a chain, LRU of leaves never takes pinned records, entries never see them."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from kvstore.codec import codec
from kvstore.errors import StoreError
from kvstore.home import tombstones
from kvstore.learned.blockstore import BlockStore, learned_summary, today
from kvstore.learned.chain import cuts
from kvstore.learned.records import slice_record
from kvstore.ops import verify
from kvstore.ops.put import LocalWriter
from kvstore.store.entry import entry_key, pack_tokens
from kvstore.store.store import Store

FP = bytes(range(16))


def kv(n: int) -> list:
    c = KVCache()
    x = mx.arange(n * 8, dtype=mx.float32).reshape(1, 1, n, 8)
    c.update_and_fetch(x, -x)
    return [c]


def records(cache: list, start: int, end: int) -> list[tuple[int, int, bytes]]:
    return [(s, e, slice_record(cache, s, e)) for s, e in cuts(start, end)]


def test_shared_start_is_stored_once_and_a_growing_prompt_adds_only_new_records(tmp_path):
    a = list(range(1, 801))
    b = a[:700] + [5000 + i for i in range(100)]
    with Store(tmp_path) as store:
        blocks = BlockStore(store)
        first = blocks.put_records(FP, a, records(kv(800), 0, 800), label="x")
        assert blocks.put_records(FP, a, records(kv(800), 0, 800), label="x") == 0  # idempotent
        assert blocks.stored_end(FP, b) == 512  # [512, 768) diverges at 700
        chain = blocks.lookup(FP, b)
        assert [m.end for m in chain] == [256, 512, 768] and blocks.served(chain, b) == 700
        more = blocks.put_records(FP, b, records(kv(800), 512, 800), label="x")
        assert blocks.learned_bytes() == first + more == blocks.written_today()
        assert blocks.stats()["records"] == 6 and blocks.stats()["chains"] == 2
        grown = a + [9] * 300  # a conversation's next turn: only [800, 1100) is new
        assert blocks.stored_end(FP, grown) == 800
        blocks.put_records(FP, grown, records(kv(1100), 800, 1100), label="x")
        assert blocks.stats()["records"] == 8
        assert [m.end for m in blocks.lookup(FP, grown)][-3:] == [800, 1024, 1100]
        assert store.metas() == [] and store.stats()["entries"] == 0  # entries never see them
    with Store(tmp_path, readonly=True) as ro:  # a client process reads without writing
        assert BlockStore(ro).stored_end(FP, grown) == 1100


def test_put_refuses_what_is_not_a_cut_or_a_record(tmp_path):
    toks = list(range(600))
    with Store(tmp_path) as store:
        blocks = BlockStore(store)
        with pytest.raises(StoreError, match="not a cut"):
            blocks.put_records(FP, toks, [(200, 300, slice_record(kv(300), 200, 300))], label="")
        with pytest.raises(Exception, match="positions"):
            blocks.put_records(FP, toks, [(0, 256, slice_record(kv(300), 0, 255))], label="")
        assert blocks.stats()["records"] == 0


def test_a_corrupt_record_ends_the_chain_before_it(tmp_path):
    toks = list(range(1, 801))
    with Store(tmp_path) as store:
        blocks = BlockStore(store)
        blocks.put_records(FP, toks, records(kv(800), 0, 800), label="x")
        chain = blocks.lookup(FP, toks)
        bad = chain[2].key
        blob = bytearray(store._read(lambda t: bytes(t.get(bad, db=blocks._db(b"bblob")))))
        blob[-5] ^= 0xFF
        store._write(lambda t: t.put(bad, bytes(blob), db=blocks._db(b"bblob")))
        assert len(blocks.read_blobs(chain)) == 2  # [0,256) and [256,512): served, never garbage
        store._write(lambda t: t.delete(bad, db=blocks._db(b"bblob")))
        assert [m.end for m in blocks.lookup(FP, toks)] == [256, 512]  # missing: not walked


def test_learned_lru_evicts_leaves_oldest_first_never_pinned(tmp_path):
    a = list(range(1, 601))
    b = a[:256] + [7000 + i for i in range(344)]
    with Store(tmp_path) as store:
        blocks = BlockStore(store)
        blocks.put_records(FP, a, records(kv(600), 0, 600), label="x")
        blocks.put_records(FP, b, records(kv(600), 256, 600), label="x")
        chain_b = blocks.lookup(FP, b)
        blocks.touch([m.key for m in chain_b], now=10**10)  # b was used last
        # pin a's leaf: it must survive
        leaf_a = blocks.lookup(FP, a)[-1]
        store._write(
            lambda t: t.put(leaf_a.key, replace(leaf_a, pins=1).pack(), db=blocks._db(b"bmeta"))
        )
        total = blocks.learned_bytes()
        freed = blocks.evict_learned(total - 1)
        assert freed > 0 and blocks.learned_bytes() == total - freed
        ends_a = [m.end for m in blocks.lookup(FP, a)]
        assert ends_a == [256, 512, 600]  # the pinned leaf kept its chain
        assert [m.end for m in blocks.lookup(FP, b)][-1] < 600  # b's unpinned leaf went
        blocks.evict_learned(0)
        assert [m.end for m in blocks.lookup(FP, a)] == [256, 512, 600]
        left = blocks.records()
        assert len(left) == 3 and blocks.learned_bytes() == sum(m.nbytes for m in left)
        s = learned_summary(blocks, store.metas(), {"learned_max_bytes": 10})
        assert s["records"] == 3 and s["budget"] == 10 and s["written_today"] > 0
        assert blocks.written_today(today()) == s["written_today"]


def test_evict_learned_records_returns_what_it_evicted(tmp_path):
    a = list(range(1, 601))
    with Store(tmp_path) as store:
        blocks = BlockStore(store)
        blocks.put_records(FP, a, records(kv(600), 0, 600), label="x")
        before = {m.key: m for m in blocks.records()}
        assert blocks.evict_learned_records(blocks.learned_bytes()) == (0, [], [])
        freed, gone, _ = blocks.evict_learned_records(0)
        assert freed == sum(m.nbytes for m in before.values()) and blocks.records() == []
        assert [m.end for m in gone] == [600, 512, 256]  # leaf first
        assert {m.key for m in gone} == set(before) and not hasattr(blocks, "evicted")


def test_a_pin_put_without_a_daemon_evicts_the_learned_records_it_holds(tmp_path):
    """The put operation, daemon or not: a pin's prefix is stored once, and the learned records
    it replaces leave a tombstone each, as every eviction does."""
    a = list(range(1, 601))
    pin = a[:590]  # the learned prefix runs 10 tokens past the pin
    with Store(tmp_path) as store:
        blocks = BlockStore(store)
        blocks.put_records(FP, a, records(kv(600), 0, 600), label="x", extra={"model": "m"})
        blob = codec.encode(kv(590))
        put = LocalWriter(store, tmp_path).put
        put(entry_key(FP, pin), blob, tokens=pack_tokens(pin), label="system", pinned=True)
        assert blocks.records() == [] and blocks.learned_bytes() == 0
    gone = tombstones.load(tmp_path, "m")
    assert sorted(t.length for t in gone) == [256, 512, 590] and {t.by for t in gone} == {"pin"}


def _flip(store, blocks, key: bytes, db: bytes, at: int = -5) -> None:
    raw = bytearray(store._read(lambda t: bytes(t.get(key, db=blocks._db(db)))))
    raw[at] ^= 0xFF
    store._write(lambda t: t.put(key, bytes(raw), db=blocks._db(db)))


def test_check_names_bad_records_and_what_they_cut_off_and_repair_drops_them(tmp_path):
    """A flipped blob (checksum), a flipped meta (its seal), a truncated blob, a lost chain link:
    each is named, with the records that follow it (no chain from position 0 reaches them); a
    healthy chain is not; repair drops exactly those and their bytes leave the learned count."""
    a, b = list(range(1, 801)), [9000 + i for i in range(600)]
    c, d = [7000 + i for i in range(300)], [5000 + i for i in range(100)]
    with Store(tmp_path) as store:
        blocks = BlockStore(store)
        for toks in (a, b, c, d):
            blocks.put_records(FP, toks, records(kv(len(toks)), 0, len(toks)), label="x")
        ca, cb, cc, cd = (blocks.lookup(FP, t) for t in (a, b, c, d))
        assert [len(ca), len(cb), len(cc), len(cd)] == [4, 3, 2, 1]
        assert blocks.check() == (10, [])
        _flip(store, blocks, ca[1].key, b"bblob")  # a's [256, 512): a bit flip in its KV
        _flip(store, blocks, cb[0].key, b"bmeta", at=20)  # b's first record's meta
        blob = store._read(lambda t: bytes(t.get(cb[2].key, db=blocks._db(b"bblob"))))
        store._write(lambda t: t.put(cb[2].key, blob[:-8], db=blocks._db(b"bblob")))
        link = cc[0].key + cc[1].key[16:]  # c: the link from its first record to its second
        store._write(lambda t: t.delete(link, db=blocks._db(b"kids")))
        total, problems = blocks.check()
        assert total == 10
        reasons = {p.key: p.reason for p in problems}
        assert "checksum mismatch" in reasons[ca[1].key]
        assert "cannot be served" in reasons[ca[2].key] and "cannot be served" in reasons[ca[3].key]
        assert "record meta" in reasons[cb[0].key]
        assert "cannot be served" in reasons[cb[1].key]
        assert f"{len(blob) - 8} bytes" in reasons[cb[2].key]
        assert "cannot be served" in reasons[cc[1].key]
        assert set(reasons) == {*[m.key for m in ca[1:]], *[m.key for m in cb], cc[1].key}
        kept = {ca[0].key, cc[0].key, cd[0].key}  # before the bad ones, and the healthy chain
        reply = verify.check(store, blocks, home=tmp_path, repair=True)
        assert reply.records == 10
        assert {p.key: p.reason for p in reply.record_problems} == reasons
        assert blocks.check() == (3, [])
        assert {m.key for m in blocks.records()} == kept
        assert blocks.learned_bytes() == sum(m.nbytes for m in blocks.records())
        assert [m.end for m in blocks.lookup(FP, a)] == [256]
        assert blocks.stats()["chains"] == 3


def test_learned_prefixes_are_each_learned_end_from_position_0(tmp_path):
    import numpy as np

    a = list(range(1, 601))  # ends at 600: off a block boundary, a learned end
    b = a[:256] + [5000 + i for i in range(256)]  # ends at 512, which nothing extends
    with Store(tmp_path) as store:
        blocks = BlockStore(store)
        blocks.put_records(FP, a, records(kv(600), 0, 600), label="x")
        blocks.put_records(FP, b, records(kv(512), 256, 512), label="x")
        got = blocks.learned_prefixes(FP, max_tokens=10_000, limit=10)
        assert sorted((np.frombuffer(t, "<u4").tolist(), end) for t, end in got) == sorted(
            [(a, 600), (b, 512)]
        )
        cut = blocks.learned_prefixes(FP, max_tokens=300, limit=1)  # the most recently used
        assert [(np.frombuffer(t, "<u4").tolist(), end) for t, end in cut] == [(b[:300], 512)]
        assert blocks.learned_prefixes(bytes(16), max_tokens=300, limit=5) == []
