"""kvstore: a persistent on-disk store of pinned-prefix KV caches for mlx-lm."""

from kvstore.errors import (
    CodecError,
    CorruptEntryError,
    DaemonError,
    KVStoreError,
    ManifestError,
    ModelError,
    ProtocolError,
    StoreError,
)
from kvstore.identity.fingerprint import Fingerprint, model_fingerprint, template_hash
from kvstore.store.entry import EntryMeta, entry_key, prefix_hash
from kvstore.store.store import Store
from kvstore.wire.daemon_client import DaemonClient, connect

__version__ = "0.1.0"

__all__ = [
    "CodecError",
    "CorruptEntryError",
    "DaemonClient",
    "DaemonError",
    "EntryMeta",
    "Fingerprint",
    "KVStoreError",
    "ManifestError",
    "ModelError",
    "ProtocolError",
    "Store",
    "StoreError",
    "connect",
    "entry_key",
    "model_fingerprint",
    "prefix_hash",
    "template_hash",
]
