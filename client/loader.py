"""What `kvstore.client.load` remembers of the files it loaded, for hydrate to check.

An app loads the weights, then hydrate fingerprints the files: a weight file replaced in between
would file the old weights' KV under the new files' fingerprint (and hydrate the new files' KV into
the old weights). `load` stats every file the fingerprint hashes before mlx-lm reads them and again
after, and tags the model with what it saw; hydrate (and PersistentPromptCache) then refuse a model
whose files changed while or since it loaded.

A model loaded some other way (plain `mlx_lm.load`) carries no such record: its in-memory weights
are bound to the fingerprinted files by comparing a sample of its parameters with the bytes in
the safetensors files (`check_weights_match`), so weights changed on disk between that load and
the fingerprint are caught too.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from kvstore.errors import KVStoreError, ModelError
from kvstore.home.settings import FILEHASH_NAME, resolve_home
from kvstore.identity.fingerprint import FileHashCache, Fingerprint, model_fingerprint
from kvstore.identity.model import ModelIdentity

log = logging.getLogger("kvstore.client")

_TAG = "_kvstore_loaded_files"  # on the model: the (path, identity) pairs it was loaded from
SAMPLE_TENSORS = 16  # weight tensors compared with the files for a model `load` did not load
SAMPLE_BYTES = 4096  # compared at each of 4 places in each of them (start, thirds, end)


def fingerprint_files(
    identity: ModelIdentity, *, home: str | Path | None = None
) -> Fingerprint | None:
    """The fingerprint (and so the identity of every file it hashes) taken before mlx-lm reads
    the files; None, with a warning, when the model cannot be fingerprinted."""
    home = resolve_home(home)
    try:
        return model_fingerprint(identity, hash_cache=FileHashCache(home / FILEHASH_NAME))
    except KVStoreError as e:
        log.warning("kvstore: cannot fingerprint %s before loading it: %s", identity.path, e)
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
    if model is None:
        return
    if not hasattr(model, _TAG):
        check_weights_match(model, fp)
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


def check_weights_match(model: Any, fp: Fingerprint) -> None:
    """Raise ModelError when `model`'s weights are not the files `fp` hashed: a sample of its
    2-D+ parameters (same name, shape and dtype in a safetensors file) is compared byte for byte
    with the files. Most sampled tensors must differ: a new weight set changes them all, while a
    model's `sanitize` may legitimately transform a few (a transposed square matrix)."""
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    from kvstore.codec.safetensors import DTYPES

    params = dict(tree_flatten(model.parameters())) if hasattr(model, "parameters") else {}
    candidates = []  # (name, file, offset of its bytes, byte length)
    for path, _, _ in fp.files:
        if not path.endswith(".safetensors"):
            continue
        try:
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
        except (OSError, ValueError) as e:
            raise ModelError(f"{path}: cannot read its safetensors header: {e}") from None
        for name, info in header.items():
            p = params.get(name)
            if name == "__metadata__" or p is None or p.ndim < 2 or not isinstance(info, dict):
                continue
            dtype = DTYPES.get(info.get("dtype", ""), (None, None))[1]
            begin, end = info.get("data_offsets", (0, 0))
            if dtype == p.dtype and tuple(info.get("shape", ())) == p.shape and end > begin:
                candidates.append((name, path, 8 + n + begin, end - begin))
    if not candidates:
        log.debug("kvstore: no parameter of the model matches a tensor of its files by name")
        return
    candidates.sort()
    step = max(1, len(candidates) // SAMPLE_TENSORS)
    differ = []
    for name, path, start, size in candidates[::step][:SAMPLE_TENSORS]:
        flat = params[name].reshape(-1).view(mx.uint8)
        width = min(SAMPLE_BYTES, size)
        offsets = sorted({0, size // 3, 2 * size // 3, size - width})
        offsets = [min(o, size - width) for o in offsets]
        loaded = [flat[o : o + width] for o in offsets]
        mx.eval(loaded)
        fd = os.open(path, os.O_RDONLY)
        try:
            on_disk = [os.pread(fd, width, start + o) for o in offsets]
        finally:
            os.close(fd)
        if any(np.asarray(a).tobytes() != b for a, b in zip(loaded, on_disk)):
            differ.append((name, path))
    compared = min(SAMPLE_TENSORS, len(candidates[::step]))
    if len(differ) * 2 > compared:
        name, path = differ[0]
        raise ModelError(
            f"the loaded weights are not those in {path} ({len(differ)} of {compared} sampled "
            f"tensors differ, e.g. {name}): the files changed since the model was loaded; "
            "load the model again (kvstore.client.load remembers which files it loaded)"
        )
    fp.check_unchanged("its weights were compared with the loaded model")
