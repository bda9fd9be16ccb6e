"""Chain hashes of a prompt: the key of every position, whoever cut it.

h_0 = xxh3_128(b"kvstore-chain-v1" + fingerprint); h_k = xxh3_128(h_{k-1} + packed block k) for
every full block of `block` tokens (packed as `kvstore.tokens.pack`). A position p is
keyed by H(p): h_{p/B} at a block boundary, else xxh3_128(h_{p//B} + packed tokens from that
boundary to p). A learned record [start, end) is filed under fingerprint + H(end), so prompts that
share a start share its records. Pure Python + xxhash: no mlx.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from kvstore import tokens as tk
from kvstore.store.keys import HASH_BYTES as HASH_BYTES

CHAIN_SEED = b"kvstore-chain-v1"

TokensLike = Sequence[int] | bytes


def packed(tokens: TokensLike) -> bytes:
    """Token ids packed as little-endian uint32 (bytes are taken as already packed)."""
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        data = bytes(tokens)
        if len(data) % tk.SIZE:
            raise ValueError(f"packed tokens must be a multiple of {tk.SIZE} bytes")
        return data
    return tk.pack(tokens)


def chain_hashes(fingerprint: bytes, tokens: TokensLike, block: int = 256) -> list[bytes]:
    """[h_0, h_1, ..., h_{n//block}]: one 16-byte hash per full block, after the root."""
    data = packed(tokens)
    step = tk.nbytes(block)
    digest = xxhash.xxh3_128_digest
    h = digest(CHAIN_SEED + fingerprint)
    out = [h]
    for i in range(0, len(data) - step + 1, step):
        h = digest(h + data[i : i + step])
        out.append(h)
    return out


def position_hash(
    fingerprint: bytes,
    tokens: TokensLike,
    p: int,
    block: int = 256,
    hashes: list[bytes] | None = None,
) -> bytes:
    """H(p), the key of position p of `tokens` (0 <= p <= len(tokens))."""
    data = packed(tokens)
    if not 0 <= p <= tk.count(data):
        raise ValueError(f"position {p} is outside 0..{tk.count(data)}")
    if hashes is None:
        hashes = chain_hashes(fingerprint, tk.cut(data, 0, p), block)
    k, r = divmod(p, block)
    if r == 0:
        return hashes[k]
    return xxhash.xxh3_128_digest(hashes[k] + tk.cut(data, k * block, p))


def cuts(start: int, end: int, block: int = 256) -> list[tuple[int, int]]:
    """[start, end) cut at every multiple of `block` strictly inside it."""
    out = []
    at = start
    while at < end:
        nxt = min(end, (at // block + 1) * block)
        out.append((at, nxt))
        at = nxt
    return out


def is_cut(start: int, end: int, block: int = 256) -> bool:
    """Whether [start, end) is one piece of `cuts`: non-empty, inside one block."""
    return 0 <= start < end and start // block == (end - 1) // block
