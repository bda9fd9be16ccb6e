"""The on-disk store of KV prefix caches: one LMDB environment per home.

It owns what an entry is and how it is keyed (`entry`: 32-byte keys, the checksummed meta record),
the `Store` that reads and writes entries in LMDB transactions (`store`), the process-wide LMDB
environments and their reader/writer gate (`lmdbenv`, shared with the fleet queue), which entries
an eviction removes (`eviction`), who keeps an entry (`ownership`), and the prefill ledger
(`ledger`). Importing it loads no mlx: only decoding or storing a cache imports the codec.
"""

from kvstore.store.entry import EntryMeta, blob_checksum, entry_key, pack_tokens, prefix_hash
from kvstore.store.store import Store

__all__ = ["EntryMeta", "Store", "blob_checksum", "entry_key", "pack_tokens", "prefix_hash"]
