"""What `client.load` remembers of the files it loaded, for hydrate to check.

An app loads the weights, then hydrate fingerprints the files: a weight file replaced in between
would file the old weights' KV under the new files' fingerprint (and hydrate the new files' KV into
the old weights). `load` stats every file the fingerprint hashes before mlx-lm reads them and again
after, and tags the model with what it saw; hydrate (and PersistentPromptCache) then refuse a model
whose files changed while or since it loaded.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from kvstore.errors import KVStoreError, ModelError
from kvstore.identity import FileHashCache, Fingerprint, model_fingerprint
from kvstore.settings import FILEHASH_NAME, resolve_home

log = logging.getLogger("kvstore.client")

_TAG = "_kvstore_loaded_files"  # on the model: the (path, identity) pairs it was loaded from


def fingerprint_files(
    path: str | Path,
    *,
    home: str | Path | None = None,
    adapter_path: str | Path | None = None,
    model_config: dict | None = None,
    **quant: Any,
) -> Fingerprint | None:
    """The fingerprint (and so the identity of every file it hashes) taken before mlx-lm reads
    the files; None, with a warning, when the model cannot be fingerprinted."""
    home = resolve_home(home)
    try:
        return model_fingerprint(
            path,
            adapter_path=adapter_path,
            model_config=model_config,
            hash_cache=FileHashCache(home / FILEHASH_NAME),
            **quant,  # kv_bits, kv_group_size, quantized_kv_start: as the entries are keyed
        )
    except KVStoreError as e:
        log.warning("kvstore: cannot fingerprint %s before loading it: %s", path, e)
        return None


def tag_loaded(model: Any, fp: Fingerprint | None, path: str | Path) -> bool:
    """Record on `model` the files `fp` saw before the load; False (and the model tainted, so
    hydrate refuses it) when one changed while mlx-lm read them."""
    if fp is None:
        return True
    try:
        fp.check_unchanged(f"mlx_lm.load read {path}")
        files: tuple | None = fp.files
    except ModelError as e:
        log.error("kvstore: %s", e)
        files = None  # tainted: hydrate refuses this model
    object.__setattr__(model, _TAG, files)
    return files is not None


def check_loaded_from(model: Any, fp: Fingerprint) -> None:
    """Raise ModelError when `model` was loaded (by `load`) from files other than those `fp`
    hashed. A model loaded some other way carries no record and passes."""
    if model is None or not hasattr(model, _TAG):
        return
    loaded = getattr(model, _TAG)
    if loaded is None:
        raise ModelError("its files changed while it was loading (see the error logged then)")
    now = {p: (ident, digest) for p, ident, digest in fp.files}
    # same identity, or (a touched file) same content: config.json is compared by identity only
    changed = [
        p
        for p, ident, digest in loaded
        if p not in now or (now[p][0] != ident and (not digest or now[p][1] != digest))
    ]
    if changed:
        raise ModelError(
            f"{', '.join(changed[:3])} changed since the model was loaded: the loaded weights "
            "are not the fingerprinted ones; load the model again"
        )
