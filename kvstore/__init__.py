"""kvstore: a persistent on-disk store of pinned-prefix KV caches for mlx-lm.

`import kvstore` stays light (no mlx, mlx-lm or transformers): the names below load their module
on first use, so the command line starts fast for commands that touch no model.
"""

from __future__ import annotations

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
from kvstore.lazy import lazy_exports

__version__ = "0.1.0"

# name -> module, imported on first access (module __getattr__, PEP 562)
_LAZY = {
    "Fingerprint": "kvstore.identity.fingerprint",
    "model_fingerprint": "kvstore.identity.fingerprint",
    "template_hash": "kvstore.identity.fingerprint",
    "entry_key": "kvstore.store.entry",
    "prefix_hash": "kvstore.store.entry",
    "EntryMeta": "kvstore.store.entry",
    "Store": "kvstore.store.store",
    "DaemonClient": "kvstore.wire.daemon_client",
    "connect": "kvstore.wire.daemon_client",
}

__all__ = [
    "CodecError",
    "CorruptEntryError",
    "DaemonError",
    "KVStoreError",
    "ManifestError",
    "ModelError",
    "ProtocolError",
    "StoreError",
    *_LAZY,
]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals(), __all__)
