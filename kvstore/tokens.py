"""Token ids as bytes: the one layout every packed token sequence has, in the store (entry meta,
learned records, chain hashes), on the wire and in memory (prefix comparisons), with its
size, byte order, pack / unpack, slicing by token index and common prefixes.

A token id is an unsigned 32-bit integer, little-endian: 4 bytes a token, so two packed
sequences share a prefix of n tokens exactly when their first 4n bytes are equal (one memcmp).
A key with ids outside that (mlx_lm.server keys an image's patch tokens with negative ids, one
per image) is not `storable`: it has no packed form, so the store neither holds nor learns it.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Union

if TYPE_CHECKING:
    import mlx.core as mx
    import numpy as np

SIZE = 4  # bytes a token id (uint32)
ORDER = "little"  # byte order of a packed token id: the store's layout, never changed

_CODE = next(c for c in ("I", "L") if array.array(c).itemsize == SIZE)  # C unsigned of 4 bytes
_SWAP = sys.byteorder != ORDER
_MAX = 2**32 - 1  # the largest id a packed token holds

# Token ids as apps hold them (what `tokens=` and a prompt of ids take): any sequence of ints, a
# numpy integer array or an mx.array, one row (kvstore.kvcheck.prefill.check_token_ids reads them).
TokenIds = Union[Sequence[int], "np.ndarray", "mx.array"]


def pack(tokens: Sequence[int]) -> bytes:
    """Token ids as packed bytes (SIZE each, ORDER); ValueError for ids outside 0 .. 2**32-1."""
    if isinstance(tokens, (list, tuple, range)):
        try:
            a = array.array(_CODE, tokens)
        except (OverflowError, TypeError):
            pass  # not plain ints in range: numpy tells (and takes what it always took)
        else:
            if _SWAP:
                a.byteswap()
            return a.tobytes()
    try:
        import numpy as np  # here, not at the top: `kvstore ls` and `stats` start without numpy

        return np.asarray(tokens, dtype="<u4").tobytes()
    except (OverflowError, ValueError, TypeError):
        raise ValueError("token ids must be integers in 0 .. 2**32-1") from None


def storable(tokens: Sequence[int]) -> bool:
    """Whether every id of `tokens` has a packed form (0 .. 2**32-1): False for a prompt with
    images as mlx_lm.server keys it (negative ids), which `pack` refuses."""
    return len(tokens) == 0 or (min(tokens) >= 0 and max(tokens) <= _MAX)


def unpack(data: bytes) -> list[int]:
    """Packed bytes back to token ids; ValueError when the length is not a multiple of SIZE."""
    a = array.array(_CODE)
    a.frombytes(data)
    if _SWAP:
        a.byteswap()
    return a.tolist()


def count(data: bytes) -> int:
    """How many token ids `data` packs."""
    return len(data) // SIZE


def nbytes(n: int) -> int:
    """The packed size of `n` token ids."""
    return SIZE * n


def cut(data: bytes, start: int, end: int | None = None) -> bytes:
    """Tokens `start` to `end` (token indices, as a slice takes them) of packed `data`."""
    return data[SIZE * start : None if end is None else SIZE * end]


def swapped(data: bytes) -> bytes:
    """Packed `data` in the other byte order (big-endian): only for what was stored so, the
    digests and tails in the home's tombstones (kvstore.reasons.tombstone_digest)."""
    a = array.array(_CODE)
    a.frombytes(data)
    a.byteswap()
    return a.tobytes()


def common_prefix(*seqs: Any) -> int:
    """How many leading tokens all of `seqs` share: packed bytes (all of them), or token id
    sequences (any mix of lists and tuples; strings compare by character). Slices compare at C
    speed, with a binary search over the length."""
    if len(seqs) == 2:
        a, b = seqs
        if type(a) is bytes and type(b) is bytes:  # the hot case: one prompt against another
            return _common(a, b) // SIZE
    kinds = {type(s) for s in seqs}
    if kinds <= _PACKED:
        size = SIZE  # a token shared in part adds no whole one
    elif kinds == {str}:
        size = 1
    else:
        size, seqs = 1, tuple(tuple(s) for s in seqs)
    return min((_common(seqs[0], s) for s in seqs[1:]), default=len(seqs[0]) if seqs else 0) // size


_PACKED = {bytes, bytearray, memoryview}


def _common(a: Any, b: Any) -> int:
    """The length of the longest common prefix of two sliceable sequences."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n - 1  # invariant: a[:lo] == b[:lo], a[:hi+1] != b[:hi+1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
