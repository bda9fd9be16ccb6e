"""kvstore: a persistent on-disk store of pinned-prefix KV caches for mlx-lm.

`import kvstore` stays light (no mlx, mlx-lm or transformers): the names below load their module
on first use, so the command line starts fast for commands that touch no model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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

if TYPE_CHECKING:  # what a user's type checker sees of the lazy names: their real types
    from kvstore.identity.fingerprint import (
        Fingerprint,
        model_fingerprint,
        template_hash,
    )
    from kvstore.store.entry import (
        EntryMeta,
        entry_key,
        prefix_hash,
    )
    from kvstore.store.store import (
        Store,
    )
    from kvstore.wire.daemon_client import (
        DaemonClient,
        connect,
    )

__all__ = [
    "CodecError",
    "CorruptEntryError",
    "DaemonError",
    "KVStoreError",
    "ManifestError",
    "ModelError",
    "ProtocolError",
    "StoreError",
    # the lazy ones, also TYPE_CHECKING imports so type checkers see them
    "DaemonClient",
    "EntryMeta",
    "Fingerprint",
    "Store",
    "connect",
    "entry_key",
    "model_fingerprint",
    "prefix_hash",
    "template_hash",
]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals(), __all__)
