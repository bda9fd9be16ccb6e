"""The byte layouts of the store's keys, packed and parsed in one place.

An entry key and a learned record key are both `fingerprint (16 bytes) + digest (16 bytes)`:
the model fingerprint, then xxh3-128 of the prefix's packed token ids (an entry) or the chain
hash H(end) of the position the record ends at (a record). Keys sort by fingerprint, so one
model's keys are one LMDB range scan. A `kids` row links a record to the one it follows:
`fingerprint + H(start) + H(end)`, i.e. the parent's key followed by the child's digest.

What `kvstore ls` shows of a key is `short_hex`: hex digits 32..44, the first 12 of the digest
(the fingerprint is shown once per model, so the digest is what tells entries apart).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

FINGERPRINT_BYTES = 16
HASH_BYTES = 16
KEY_BYTES = FINGERPRINT_BYTES + HASH_BYTES
SHORT_HEX_DIGITS = 12  # hex digits of the digest that `ls` shows

_FP_HEX = 2 * FINGERPRINT_BYTES


class Key(NamedTuple):
    fingerprint: bytes
    digest: bytes  # xxh3-128 of the packed tokens (an entry) or H(end) (a learned record)


class KidsRow(NamedTuple):
    parent: bytes  # the key of the record the child follows (fingerprint + H(start))
    child: bytes  # the child record's key (fingerprint + H(end))


def pack_key(fingerprint: bytes, digest: bytes) -> bytes:
    return bytes(fingerprint) + bytes(digest)


def parse_key(key: bytes) -> Key:
    return Key(bytes(key[:FINGERPRINT_BYTES]), bytes(key[FINGERPRINT_BYTES:]))


def fingerprint_of(key: bytes) -> bytes:
    """The model fingerprint a key (entry, record or kids row) starts with."""
    return bytes(key[:FINGERPRINT_BYTES])


def digest_of(key: bytes) -> bytes:
    """What follows the fingerprint: the prefix hash (entry) or H(end) (record)."""
    return bytes(key[FINGERPRINT_BYTES:])


def kids_row(parent: bytes, child: bytes) -> bytes:
    """The `kids` row linking record `child` to the record (or root) key `parent` it follows."""
    return bytes(parent) + digest_of(child)


def parse_kids_row(row: bytes) -> KidsRow:
    row = bytes(row)
    return KidsRow(row[:KEY_BYTES], row[:FINGERPRINT_BYTES] + row[KEY_BYTES:])


def kids_links(rows: Iterable[bytes], fingerprint: bytes) -> dict[bytes, bytes]:
    """{child: parent} of the `kids` rows of model `fingerprint`, read in key order from `rows`
    until the first row of another model, as `parse_kids_row` reads each (a slice and a dict
    slot a row, no record: a reader walks every row of a model on each change of the store)."""
    links: dict[bytes, bytes] = {}
    for k in rows:
        if not k.startswith(fingerprint):
            break
        links[k[:FINGERPRINT_BYTES] + k[KEY_BYTES:]] = k[:KEY_BYTES]
    return links


def short_hex(key: bytes | str) -> str:
    """The short form of a key that `ls`, `evict` and `remote ls` print (a key or its hex)."""
    text = key if isinstance(key, str) else key.hex()
    return text[_FP_HEX : _FP_HEX + SHORT_HEX_DIGITS]


def digest_hex(key: bytes | str) -> str:
    """The hex of a key's digest (what a short key given on the command line is matched to)."""
    text = key if isinstance(key, str) else key.hex()
    return text[_FP_HEX:]
