"""The LMDB store: entry keys and meta, the one Store class, eviction, ownership, the ledger."""
