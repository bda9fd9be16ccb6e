"""kvstore.tokens: the one layout of packed token ids (the store's, the wire's, the reasons'), and
common prefixes of packed bytes and of token sequences."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvstore import tokens as tk


def test_packed_is_little_endian_uint32_as_the_store_keeps_it():
    ids = [0, 1, 255, 256, 2**32 - 1]
    assert tk.pack(ids) == np.asarray(ids, dtype="<u4").tobytes()
    assert tk.pack(tuple(ids)) == tk.pack(np.asarray(ids)) == tk.pack(ids)
    assert tk.unpack(tk.pack(ids)) == ids
    assert tk.count(tk.pack(ids)) == len(ids) and tk.nbytes(len(ids)) == len(tk.pack(ids))
    assert tk.swapped(tk.pack([1])) == b"\x00\x00\x00\x01"


@pytest.mark.parametrize("bad", [[-1], [2**32], ["a"]])
def test_an_id_outside_uint32_is_a_value_error(bad):
    with pytest.raises(ValueError, match="token ids"):
        tk.pack(bad)


def test_cut_slices_by_token_index():
    data = tk.pack([10, 11, 12, 13])
    assert tk.unpack(tk.cut(data, 1, 3)) == [11, 12]
    assert tk.unpack(tk.cut(data, 2)) == [12, 13]
    assert tk.unpack(tk.cut(data, -1)) == [13]


def test_common_prefix_of_packed_bytes_and_of_sequences_agree():
    rng = random.Random(0)
    for _ in range(500):
        a = [rng.randrange(3) for _ in range(rng.randrange(12))]
        b = a[: rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(4))]
        want = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert tk.common_prefix(a, b) == tk.common_prefix(tuple(a), b) == want
        assert tk.common_prefix(tk.pack(a), tk.pack(b)) == want  # whole tokens, never bytes
        assert tk.common_prefix(a, b, a) == want
    assert tk.common_prefix(tk.pack([1, 2]), tk.pack([1, 2 + 2**24])) == 1  # low bytes agree
    assert tk.common_prefix("abcd", "abxd") == 2 and tk.common_prefix() == 0
