"""`kvstore verify` checks learned block records too: with their bytes flipped it names each one
and exits 1; `--repair` drops them (through the daemon when one holds the home) and what is left
verifies clean."""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers import Proc, cli, serving
from mlx_lm.models.cache import KVCache

from kvstore.learned.blockstore import BlockStore
from kvstore.learned.chain import cuts
from kvstore.learned.records import slice_record
from kvstore.store.store import Store

FP = bytes(range(16))


def _learned(home, chains: int = 3) -> list[bytes]:
    """`chains` chains of 300 tokens (two records each) with every record's blob flipped;
    returns the records' keys."""
    keys = []
    with Store(home) as store:
        blocks = BlockStore(store)
        for i in range(chains):
            tokens = [1000 * (i + 1) + t for t in range(300)]
            c = KVCache()
            x = mx.arange(300 * 8, dtype=mx.float32).reshape(1, 1, 300, 8)
            c.update_and_fetch(x, -x)
            records = [(s, e, slice_record([c], s, e)) for s, e in cuts(0, 300)]
            blocks.put_records(FP, tokens, records, label=f"chain{i}")
        for m in blocks.records():
            raw = bytearray(
                store._read(lambda t, k=m.key: bytes(t.get(k, db=blocks._db(b"bblob"))))
            )
            raw[len(raw) // 2] ^= 0x01
            store._write(lambda t, k=m.key, v=bytes(raw): t.put(k, v, db=blocks._db(b"bblob")))
            keys.append(m.key)
    return keys


def _left(home) -> int:
    with Store(home, readonly=True) as store:
        blocks = BlockStore(store)
        return len(blocks.records()) + blocks.learned_bytes()


def test_verify_names_flipped_learned_records_and_repair_drops_them(kv_home):
    keys = _learned(kv_home)
    result = cli("verify", "--home", kv_home)
    assert result.exit_code == 1, result.output
    for k in keys:
        assert f"bad learned record {k.hex()}: record blob checksum mismatch" in result.output
    assert "6 learned records of 6 failed; `kvstore verify --repair` drops them" in result.output
    assert _left(kv_home) > 0  # checking alone changes nothing
    result = cli("verify", "--repair", "--home", kv_home)
    assert result.exit_code == 1 and "6 learned records of 6 failed (deleted)" in result.output
    assert _left(kv_home) == 0  # gone, and out of the learned budget's count
    assert cli("verify", "--home", kv_home, code=0).output.strip() == "0 entries ok"


@pytest.mark.slow
def test_verify_repair_drops_learned_records_through_the_daemon(kv_home, tmp_path):
    keys = _learned(kv_home, chains=2)
    with serving(Proc(kv_home, log=tmp_path / "d.log"), warm=False) as d:
        result = cli("verify", "--repair", "--home", kv_home)
        assert result.exit_code == 1 and "4 learned records of 4 failed (deleted)" in result.output
        for k in keys:
            assert f"bad learned record {k.hex()}" in result.output
            assert f"repair: deleted learned record {k.hex()}" in d.text()
        assert d.request("stats")["learned"]["records"] == 0
    assert _left(kv_home) == 0


def test_repair_evicts_learned_records_through_the_one_eviction(kv_home, caplog):
    """`verify --repair` drops a corrupt learned record as every eviction does: the `corrupt`
    metric, a log line saying why, and a tombstone of its chain's tokens where they are known
    (none for a record whose meta cannot be read, nor one whose chain it broke)."""
    import logging

    from kvstore import metrics
    from kvstore.home import tombstones
    from kvstore.ops import verify

    keys = _learned(kv_home, chains=2)  # every blob flipped
    with Store(kv_home) as store:
        blocks = BlockStore(store)
        (unread,) = [m.key for m in blocks.records() if m.start == 0 and m.label == "chain1"]
        store._write(lambda t: t.put(unread, b"\x00garbage", db=blocks._db(b"bmeta")))
    before = metrics.REGISTRY.get_sample_value("kvstore_evictions_total", {"reason": "corrupt"})
    with caplog.at_level(logging.INFO, logger="kvstore"), Store(kv_home) as store:
        reply = verify.check(store, BlockStore(store), home=kv_home, repair=True)
        assert {p.key for p in reply.record_problems} == set(keys)
    after = metrics.REGISTRY.get_sample_value("kvstore_evictions_total", {"reason": "corrupt"})
    assert (after or 0) - (before or 0) == 4
    assert _left(kv_home) == 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("evicted ")]
    for k in keys:
        assert any(k.hex() in ln and ": corrupt (" in ln for ln in lines), (k.hex(), lines)
    assert any(unread.hex() in ln and "unreadable" in ln for ln in lines), lines
    stones = tombstones.load(kv_home, "")  # the records were put without a model
    assert {s.length for s in stones} == {256, 300}  # chain0's two records; chain1's none
    assert all(s.by == "verify --repair" for s in stones)
    assert any(s.covers([1000 + t for t in range(300)]) for s in stones)
