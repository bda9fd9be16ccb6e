"""Corrupt blob, corrupt meta, truncated value, disallowed class: verify names them, hydrate
skips them (and inserts the healthy ones), nothing raises into the app."""

from __future__ import annotations

import json
import struct

import pytest
from helpers import cli
from mlx_lm.models.cache import LRUPromptCache

from kvstore.client import hydrate
from kvstore.store.entry import blob_checksum
from kvstore.store.store import Store


def _raw_put(home, key: bytes, *, meta: bytes | None = None, blob: bytes | None = None):
    with Store(home) as store, store.env.begin(write=True) as txn:
        if meta is not None:
            txn.put(key, meta, db=store._meta)
        if blob is not None:
            txn.put(key, blob, db=store._blob)


def _with_class_name(blob: bytes, old: str, new: str) -> bytes:
    """Rewrite a class name in the safetensors header, keeping the blob otherwise valid."""
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8 : 8 + n])
    header["__metadata__"] = {
        k: (new if v == old else v) for k, v in header["__metadata__"].items()
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw + blob[8 + n :]


def _doctor(home, key: bytes, how: str) -> None:
    with Store(home) as store:
        meta = store.get_meta(key)
        blob = store.read_blob(key)
    if how == "bitflip":
        b = bytearray(blob)
        b[len(b) // 2] ^= 0x10
        _raw_put(home, key, blob=bytes(b))
    elif how == "meta":
        _raw_put(home, key, meta=b"\xc1not msgpack")
    elif how == "truncated":
        _raw_put(home, key, blob=blob[: len(blob) // 3])
    elif how == "class":
        bad = _with_class_name(blob, "KVCache", "Path")
        meta.nbytes, meta.checksum = len(bad), blob_checksum(bad)
        _raw_put(home, key, meta=meta.pack(), blob=bad)


@pytest.mark.parametrize(
    "how,reason",
    [
        ("bitflip", "checksum"),
        ("meta", "unreadable meta"),
        ("truncated", "blob is"),
        ("class", "not allowed"),
    ],
)
def test_verify_names_and_hydrate_skips(warmed, llama_path, kv_home, how, reason):
    bad, good = warmed["classify"], warmed["synthesize"]
    _doctor(kv_home, bad.key, how)

    result = cli("verify", "--home", kv_home)
    assert result.exit_code == 1
    assert bad.key.hex() in result.output and reason in result.output
    assert good.key.hex() not in result.output

    lru = LRUPromptCache()
    report = hydrate(lru, "m", llama_path, home=kv_home)
    assert report.entries == 1 and report.labels == ["synthesize"]
    assert report.warning and "verify" in report.warning
    assert any(bad.key.hex() in s for s in report.skipped)

    # repair deletes only the bad entry; the store then verifies clean
    result = cli("verify", "--repair", "--home", kv_home)
    assert result.exit_code == 1 and "deleted" in result.output
    result = cli("verify", "--home", kv_home)
    assert result.exit_code == 0, result.output
    with Store(kv_home) as store:
        assert [m.label for m in store.metas()] == ["synthesize"]


def test_garbage_store_file_gives_one_warning(llama_path, kv_home):
    (kv_home / "store").mkdir(parents=True)
    (kv_home / "store" / "data.mdb").write_bytes(b"\0garbage" * 1000)
    lru = LRUPromptCache()
    report = hydrate(lru, "m", llama_path, home=kv_home)
    assert report.entries == 0 and "prefilling as usual" in report.warning


def test_kv_that_does_not_cover_its_tokens_is_rejected(llama_path, kv_home):
    """A cache of 5 tokens stored under 3 token ids would serve KV for tokens not asked for."""
    from mlx_lm import load

    from kvstore.codec import codec
    from kvstore.kvcheck.prefill import prefill
    from kvstore.store.entry import entry_key, pack_tokens

    model, _ = load(str(llama_path))
    from kvstore.identity.fingerprint import model_fingerprint

    fp = model_fingerprint(llama_path).digest
    blob = codec.encode(prefill(model, [5, 6, 7, 8, 9]))
    with Store(kv_home) as store:
        bad = store.put(entry_key(fp, [5, 6, 7]), blob, tokens=pack_tokens([5, 6, 7]))
        good = store.put(entry_key(fp, [5, 6, 7, 8, 9]), blob, tokens=pack_tokens([5, 6, 7, 8, 9]))
        problems = store.check()
    assert [p.key for p in problems] == [bad.key] and "holds 5 tokens" in problems[0].reason
    lru = LRUPromptCache()
    report = hydrate(lru, "m", llama_path, home=kv_home)
    assert report.entries == 1 and any(bad.key.hex() in s for s in report.skipped)
    assert good.key != bad.key


def test_repair_evicts_through_the_one_eviction(warmed, kv_home, caplog):
    """`verify --repair` drops a corrupt entry as every eviction does: a tombstone (where its
    meta still names its tokens), the `corrupt` metric and a log line saying why."""
    import logging

    from kvstore import metrics
    from kvstore.home import tombstones
    from kvstore.learned.blockstore import BlockStore
    from kvstore.ops import verify

    flipped, unread = warmed["classify"], warmed["synthesize"]
    _doctor(kv_home, flipped.key, "bitflip")
    _doctor(kv_home, unread.key, "meta")
    before = metrics.REGISTRY.get_sample_value("kvstore_evictions_total", {"reason": "corrupt"})
    with caplog.at_level(logging.INFO, logger="kvstore"), Store(kv_home) as store:
        reply = verify.check(store, BlockStore(store), home=kv_home, repair=True)
        assert len(reply.problems) == 2 and store.metas() == []
    after = metrics.REGISTRY.get_sample_value("kvstore_evictions_total", {"reason": "corrupt"})
    assert after - (before or 0) == 2
    (stone,) = tombstones.load(kv_home, flipped.model)
    assert stone.by == "verify --repair" and stone.covers(flipped.token_ids())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("evicted ")]
    assert any(flipped.key.hex() in ln and "corrupt (blob" in ln for ln in lines), lines
    assert any(unread.key.hex() in ln and "corrupt (unreadable meta" in ln for ln in lines), lines
