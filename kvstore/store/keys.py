"""Entry keys: model fingerprint (16 bytes) + xxh3-128 of the prefix token ids (16 bytes).

Keys sort by fingerprint, so one model's entries are one LMDB range scan. The hash only finds the
candidate: stored token ids are compared on every hit.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

FINGERPRINT_BYTES = 16
KEY_BYTES = 32


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32: compact in meta and compared in one memcmp."""
    import numpy as np  # here, not at the top: `kvstore ls` and `stats` start without numpy

    try:
        return np.asarray(tokens, dtype="<u4").tobytes()
    except (OverflowError, ValueError, TypeError):
        raise ValueError("token ids must be integers in 0 .. 2**32-1") from None


def unpack_tokens(data: bytes) -> list[int]:
    import numpy as np

    return np.frombuffer(data, dtype="<u4").tolist()


def prefix_hash(tokens: Sequence[int]) -> bytes:
    return packed_prefix_hash(pack_tokens(tokens))


def packed_prefix_hash(packed: bytes) -> bytes:
    """The key's second half from packed token ids (what every read re-checks)."""
    return xxhash.xxh3_128_digest(packed)


def entry_key(fingerprint: bytes, tokens: Sequence[int]) -> bytes:
    if len(fingerprint) != FINGERPRINT_BYTES:
        raise ValueError(f"fingerprint must be {FINGERPRINT_BYTES} bytes, got {len(fingerprint)}")
    return fingerprint + prefix_hash(tokens)


def parse_key(text: str) -> bytes:
    """A key given on the command line as hex (a unique prefix is resolved by the caller)."""
    return bytes.fromhex(text)
