"""Bad bytes in a fetched object are "corrupt", whatever shape they take: the decode catches what
reading them raises (kvstore.degrade.UNREADABLE), nothing broader, and no bad object escapes as
another error type."""

from __future__ import annotations

import random

import msgpack
import pytest

from kvstore.errors import RemoteError
from kvstore.fleet.objects import (
    FORMAT_VERSION,
    HEADER,
    RECORD_MAGIC,
    TRAILER,
    TRAILER_MAGIC,
    authenticate,
    verify_record,
)

KEY = bytes(48)


@pytest.mark.parametrize(
    "head",
    [
        2**63,
        None,
        [1],
        {1: 2},
        {"prefix": 2**63, "block": 1, "record": b""},
        {"prefix": -1, "block": 1, "record": b""},
        {"prefix": "text", "block": 1, "record": b""},
        {"prefix": b"", "block": "zz", "record": b""},
        {"prefix": b"", "block": float("inf"), "record": b""},
        {"prefix": b"", "block": 1, "record": 5},
    ],
)
def test_a_record_head_of_any_wrong_shape_is_corrupt(head):
    packed = msgpack.packb(head, use_bin_type=True)
    data = HEADER.pack(RECORD_MAGIC, FORMAT_VERSION, len(packed)) + packed
    with pytest.raises(RemoteError) as got:
        verify_record(KEY, data)
    assert got.value.cause == "corrupt"


def test_any_provenance_bytes_are_read_or_corrupt():
    rng = random.Random(35)
    shapes = [{"box": 1}, {"box": "a", "mlx": "b", "mlx_lm": [1]}, [1, 2], "s", None]
    for i in range(2000):
        prov = (
            msgpack.packb(rng.choice(shapes))
            if i % 3 == 0
            else bytes(rng.randrange(256) for _ in range(rng.randrange(24)))
        )
        tail = prov + TRAILER.pack(TRAILER_MAGIC, len(prov), bytes(32))
        try:
            authenticate(memoryview(b"x" + tail), 1, (), "an object")
        except RemoteError as e:
            assert e.cause == "corrupt"


@pytest.mark.parametrize("kv_layers", ["0,1", 3, {"0": 1}])
def test_an_entry_whose_stored_kv_layers_is_not_a_list_is_corrupt(kv_layers):
    """An entry object's `kv_layers` is checked as stored: a value of another type is refused, not
    read as absent (the typed extra reads a wrong-typed value as None)."""
    import mlx.core as mx
    import xxhash
    from mlx_lm.models.cache import KVCache

    from kvstore.codec import codec
    from kvstore.fleet.objects import _check_blob
    from kvstore.store.entry import EntryExtra, EntryMeta, entry_key, pack_tokens

    c = KVCache()
    c.update_and_fetch(mx.zeros((1, 1, 3, 4)), mx.zeros((1, 1, 3, 4)))
    blob = codec.encode([c])
    tokens = [1, 2, 3]
    meta = EntryMeta(entry_key(b"\x01" * 16, tokens), pack_tokens(tokens), 3, "x", False, "/m",
                     b"\x01" * 16, b"\0" * 16, 0.0, 0.0, 0, len(blob),
                     xxhash.xxh3_64_intdigest(blob), 1, [],
                     EntryExtra.from_map({"kv_layers": kv_layers}))  # fmt: skip
    with pytest.raises(RemoteError) as got:
        _check_blob(memoryview(blob), meta, "an object")
    assert got.value.cause == "corrupt" and "kv_layers is not a list" in str(got.value)
