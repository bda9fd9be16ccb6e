"""The large-blob read path (one mlx buffer filled on threads, checksum alongside the copy) gives
the same arrays as mlx-lm's own loader and as the per-tensor path, refuses what it must, and
leaves no thread behind."""

from __future__ import annotations

import json
import struct
import threading

import mlx.core as mx
import pytest
from helpers import assert_same_kv, mlx_lm_prefill, states, warm_two_pins
from mlx_lm import load
from mlx_lm.models.cache import LRUPromptCache, load_prompt_cache

from bench.shapes import HYBRID_9B, KV28_F16, KV36_BF16, make_cache
from kvstore.client import hydrate
from kvstore.codec import codec, materialize
from kvstore.errors import ChecksumError, CodecError, CorruptEntryError
from kvstore.store.entry import blob_checksum, entry_key, pack_tokens
from kvstore.store.store import Store
from kvstore.warm.transfer import write_file


def _bytes_equal(a: list, b: list) -> None:
    sa, sb = states(a), states(b)
    assert len(sa) == len(sb)
    for x, y in zip(sa, sb, strict=True):
        assert (x.dtype, x.shape) == (y.dtype, y.shape)
        assert bytes(memoryview(x)) == bytes(memoryview(y))  # bit for bit, NaN patterns too


def _paths(monkeypatch, path: str) -> None:
    monkeypatch.setattr(materialize, "LARGE_BYTES", 0 if path == "large" else 1 << 62)
    monkeypatch.setattr(materialize, "_recycled", lambda nbytes: False)


@pytest.mark.parametrize("shape", [KV28_F16, KV36_BF16, HYBRID_9B], ids=lambda s: s.name)
def test_large_path_equals_load_prompt_cache_of_the_same_bytes(shape, tmp_path, monkeypatch):
    blob = codec.encode(make_cache(shape, 80))
    write_file(blob, tmp_path / "c.safetensors")  # as `kvstore export` writes it
    _paths(monkeypatch, "large")
    reference = load_prompt_cache(str(tmp_path / "c.safetensors"))
    views = []
    real = materialize._views
    monkeypatch.setattr(materialize, "_views", lambda *a: views.append(1) or real(*a))
    got, _ = codec.decode(blob, checksum=blob_checksum(blob))
    assert views == [1]  # the one-buffer path ran
    _bytes_equal(got, reference)
    _paths(monkeypatch, "small")
    small, _ = codec.decode(blob, checksum=blob_checksum(blob))
    _bytes_equal(small, got)


@pytest.mark.parametrize("path", ["large", "small"])
def test_arrays_own_their_memory_after_the_blob_is_gone(path, monkeypatch):
    _paths(monkeypatch, path)
    blob = bytearray(codec.encode(make_cache(KV28_F16, 80)))
    got, _ = codec.decode(blob)
    expected = [bytes(memoryview(x)) for x in states(got)]
    blob[:] = bytes(len(blob))  # the buffer is reused, as an LMDB page would be
    assert [bytes(memoryview(x)) for x in states(got)] == expected


def _unaligned_blob() -> bytes:
    """A one-layer KVCache laid out as another writer might: the offset scalar as one U8 byte
    first, so the float16 keys and values start at odd offsets."""
    cache = make_cache(KV28_F16, 40)[:1]
    meta = json.loads(codec.encode(cache)[8:].split(b"}}", 1)[0] + b"}}")["__metadata__"]
    k, v = (memoryview(mx.contiguous(x[..., :40, :])).tobytes() for x in cache[0].state[:2])
    parts = [("0.2", "U8", [], bytes([40])), ("0.0", "F16", [1, 8, 40, 128], k),
             ("0.1", "F16", [1, 8, 40, 128], v)]  # fmt: skip
    header, off = {"__metadata__": meta}, 0
    for name, code, shape, data in parts:
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [off, off + len(data)]}
        off += len(data)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + b"".join(p[3] for p in parts)


def test_unaligned_blob_takes_the_per_tensor_path(tmp_path, monkeypatch):
    blob = _unaligned_blob()
    write_file(blob, tmp_path / "u.safetensors")
    _paths(monkeypatch, "large")
    copies = []
    real = materialize._copy_one
    monkeypatch.setattr(materialize, "_copy_one", lambda *a: copies.append(a[2]) or real(*a))
    got, _ = codec.decode(blob)
    assert sorted(copies) == ["0.0", "0.1"]
    assert got[0].offset == 40
    _bytes_equal(got, load_prompt_cache(str(tmp_path / "u.safetensors")))


@pytest.mark.parametrize("where", ["header", "data"])
def test_corrupted_large_blob_is_refused_with_no_arrays_returned(where, kv_home, monkeypatch):
    _paths(monkeypatch, "large")
    blob = bytearray(codec.encode(make_cache(KV28_F16, 80)))
    checksum = blob_checksum(blob)
    pos = 12 if where == "header" else len(blob) - 7
    blob[pos] ^= 0x20
    calls = []
    real = materialize.arrays

    def watch(*a, **k):
        out = real(*a, **k)
        calls.append(out[1])
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(materialize, "arrays", watch)
        with pytest.raises(ChecksumError, match="checksum mismatch"):
            codec.decode(bytes(blob), checksum=checksum)
    # a broken header is refused before any copy; broken data after the copy, arrays dropped
    assert calls == ([] if where == "header" else [False])
    with pytest.raises(CodecError):
        codec.decode(bytes(blob[:-1]))
    # through the store: the checksum names the entry, and hydrate skips it with one warning
    ids = list(range(80))
    key = entry_key(b"\x01" * 16, ids)
    blob[pos] ^= 0x20
    good = bytes(blob)
    blob[pos] ^= 0x20
    with Store(kv_home) as s:
        s.put(key, good, tokens=pack_tokens(ids))  # the meta holds the good blob's checksums
        s._write(lambda txn: txn.put(key, bytes(blob), db=s._blob))  # then the blob changes
        with pytest.raises(CorruptEntryError, match="blob checksum mismatch"):
            s.load(key)


def test_checksum_in_chunks_is_xxh3_64():
    import xxhash

    for n in (0, 1, materialize.CHUNK_BYTES, materialize.CHUNK_BYTES * 2 + 3):
        data = bytes(range(256)) * (n // 256) + bytes(n % 256)
        assert materialize.checksum(data) == xxhash.xxh3_64_intdigest(data)


def test_no_thread_outlives_a_large_decode(monkeypatch):
    _paths(monkeypatch, "large")
    before = set(threading.enumerate())
    for _ in range(3):
        codec.decode(codec.encode(make_cache(KV28_F16, 80)))
    # mlx's io threads call readinto; had they made Python threads, dummies would show here
    assert set(threading.enumerate()) == before


def test_large_path_hydrate_equals_fresh_prefill(hybrid_path, kv_home, tmp_path, monkeypatch):
    """A real model's KV through the threaded path (threshold 0) equals a fresh prefill."""
    metas = warm_two_pins(tmp_path, kv_home, hybrid_path)
    _paths(monkeypatch, "large")
    model, _ = load(str(hybrid_path))
    lru = LRUPromptCache(max_size=10)
    report = hydrate(lru, "m", hybrid_path, home=kv_home, model=model)
    assert report.warning is None and report.entries == 2
    for meta in metas.values():
        cache, rest = lru.fetch_nearest_cache("m", meta.token_ids())
        assert rest == []
        assert_same_kv(cache, mlx_lm_prefill(model, meta.token_ids()))
        # and the hydrated cache keeps working: one more token, same logits as the cold cache
        cold = mlx_lm_prefill(model, meta.token_ids())
        nxt = mx.array([[5]])
        assert mx.array_equal(model(nxt, cache=cache), model(nxt, cache=cold)).item()


def _stored_with_chunk_sums(kv_home, monkeypatch, blob: bytes):
    """`blob` stored under small checksum chunks (64 KiB), so a test-sized blob has many."""
    from kvstore.store import entry

    monkeypatch.setattr(entry, "CHUNK_SUM_BYTES", 64 << 10)
    ids = list(range(80))
    key = entry_key(b"\x01" * 16, ids)
    with Store(kv_home) as s:
        meta = s.put(key, blob, tokens=pack_tokens(ids))
    return key, meta


@pytest.mark.parametrize("where", ["header", "first data chunk", "middle", "last byte"])
def test_large_blob_checked_by_chunks_still_refuses_a_flipped_byte(where, kv_home, monkeypatch):
    """A large entry's checksum is checked on the copied bytes, chunk by chunk (the sums stored
    with it), with no separate pass; a flipped byte anywhere is still refused."""
    _paths(monkeypatch, "large")
    blob = codec.encode(make_cache(KV28_F16, 80))
    key, meta = _stored_with_chunk_sums(kv_home, monkeypatch, blob)
    size, sums = meta.chunk_sums
    assert size == 64 << 10 and len(sums) == -(-len(blob) // size)
    passes = []
    real = materialize.checksum
    monkeypatch.setattr(materialize, "checksum", lambda b: passes.append(1) or real(b))
    with Store(kv_home, readonly=True) as s:
        _, good = s.load(key)
    assert passes == []  # checked while copying: no pass of its own
    _bytes_equal(good, codec.decode(blob)[0])
    n = int.from_bytes(blob[:8], "little")
    pos = {"header": 8 + n - 20, "first data chunk": 8 + n + 5, "middle": len(blob) // 2,
           "last byte": len(blob) - 1}[where]  # fmt: skip
    bad = bytearray(blob)
    bad[pos] ^= 0x01
    with Store(kv_home) as s:
        s._write(lambda txn: txn.put(key, bytes(bad), db=s._blob))
    with Store(kv_home, readonly=True) as s, pytest.raises(CorruptEntryError):
        s.load(key)


def test_chunk_sums_are_the_stores_own(kv_home, monkeypatch):
    """put computes the chunk sums itself (a caller's are dropped), they are sealed with the
    meta, an entry without them (stored by earlier code) is checked whole, and ls leaves them
    out."""
    from kvstore.store import entry

    blob = codec.encode(make_cache(KV28_F16, 80))
    monkeypatch.setattr(entry, "CHUNK_SUM_BYTES", 64 << 10)
    ids = list(range(80))
    key = entry_key(b"\x01" * 16, ids)
    forged = {"bytes": 64 << 10, "sums": [0] * (-(-len(blob) // (64 << 10)))}
    with Store(kv_home) as s:
        meta = s.put(key, blob, tokens=pack_tokens(ids), extra={"chunk_sums": forged})
    assert meta.chunk_sums[1] != forged["sums"]
    assert "chunk_sums" not in meta.to_json()
    # an older entry: no chunk sums in its extra; the whole checksum guards it
    _paths(monkeypatch, "large")
    old = meta
    old.extra = meta.extra.without("chunk_sums")
    assert old.chunk_sums is None
    bad = bytearray(blob)
    bad[len(blob) // 2] ^= 0x01
    with Store(kv_home) as s:
        s._write(lambda txn: txn.put(key, old.pack(), db=s._meta))
        _, cache = s.load(key)  # intact: hydrates through the whole-blob checksum
        _bytes_equal(cache, codec.decode(blob)[0])
        s._write(lambda txn: txn.put(key, bytes(bad), db=s._blob))
        with pytest.raises(CorruptEntryError, match="blob checksum mismatch"):
            s.load(key)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_copy_runs_on_our_own_threads_whatever_their_number(threads, monkeypatch):
    """Each share of the copy on a worker thread of ours, one worker too (a machine with one
    core), never on mlx's io thread (which calls readinto): copying there aborted the process at
    exit now and then."""
    _paths(monkeypatch, "large")
    monkeypatch.setattr(materialize, "THREADS", threads)
    where = []
    real = materialize._populate
    monkeypatch.setattr(
        materialize, "_populate", lambda d: where.append(threading.current_thread().name) or real(d)
    )
    blob = codec.encode(make_cache(KV28_F16, 80))
    codec.decode(blob, checksum=blob_checksum(blob))
    assert len(where) == threads and all(n.startswith("kvstore-copy-") for n in where)
