"""The on-disk store of KV prefix caches: one LMDB environment per home.

It owns the byte layouts of keys and chain links (`keys`: 32-byte keys, fingerprint first), what
an entry is and the fields a put gives it (`entry`: the checksummed meta record, `PutFields`), the
`Store` that reads and writes entries in LMDB transactions (`store`), and the process-wide LMDB
environments and their reader/writer gate (`lmdbenv`, shared with the fleet queue). The learned
records' tables in the same environment are kvstore.learned's, written through the Store's public
transactions. Importing it loads no mlx: only decoding or storing a cache imports the codec.
"""

from typing import TYPE_CHECKING

from kvstore.lazy import lazy_exports

if TYPE_CHECKING:
    from kvstore.store.entry import EntryMeta, blob_checksum, entry_key, pack_tokens, prefix_hash
    from kvstore.store.store import Store

# name -> module, imported on first use: `kvstore.store.keys` alone loads no LMDB or msgpack
_LAZY = {
    "EntryMeta": "kvstore.store.entry",
    "blob_checksum": "kvstore.store.entry",
    "entry_key": "kvstore.store.entry",
    "pack_tokens": "kvstore.store.entry",
    "prefix_hash": "kvstore.store.entry",
    "Store": "kvstore.store.store",
}

__all__ = ["EntryMeta", "Store", "blob_checksum", "entry_key", "pack_tokens", "prefix_hash"]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals(), __all__)
