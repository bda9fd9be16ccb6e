"""The per-layer cache layout of a model, remembered across process starts.

Without a loaded model, the fingerprint's cache layout comes from instantiating the architecture
from config.json (kvstore.identity.cache_layout): in a fresh process that imports the model module
and builds every layer, ~20 ms for a 9B config, more than hydrating a few MB. The layout depends
only on config.json and mlx-lm's code, so it is kept in the home keyed by the config's bytes and
the identity (size, mtime) of mlx-lm's model sources; any change to either rebuilds it.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import msgpack
import xxhash

from kvstore.identity import cache_layout, resolve_model_path

LAYOUT_CACHE_NAME = "layouts.msgpack"
_MAX_ENTRIES = 64


@functools.cache  # the running process's mlx-lm is the one it imported: stat its files once
def _mlx_lm_sources() -> bytes:
    import mlx_lm

    root = Path(mlx_lm.__file__).parent
    h = xxhash.xxh3_128(getattr(mlx_lm, "__version__", "?").encode())
    for d in (root, root / "models"):
        # scandir and string names: sorting ~140 Path objects alone took 5 ms in a new process
        with os.scandir(d) as it:
            files = sorted((e.name, e) for e in it if e.name.endswith(".py") and e.is_file())
        for name, e in files:
            st = e.stat()
            h.update(f"{d.name}/{name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.digest()


def _key(model_dir: Path) -> str:
    config = (model_dir / "config.json").read_bytes()
    return xxhash.xxh3_128(config + _mlx_lm_sources()).hexdigest()


def _tuples(x: Any) -> Any:
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def cached_layout(model: str | Path, home: Path) -> tuple:
    """`cache_layout(model_dir)` from the home's layout cache, computed and stored on a miss. A
    damaged or unwritable cache only costs the rebuild."""
    model_dir = resolve_model_path(model)
    path = home / LAYOUT_CACHE_NAME
    try:
        key = _key(model_dir)
    except OSError:
        return cache_layout(model_dir)  # its ModelError names the missing config
    table: dict = {}
    try:
        table = msgpack.unpackb(path.read_bytes(), raw=False)
        if not isinstance(table, dict):
            table = {}
        hit = table.get(key)
        if isinstance(hit, list):
            return _tuples(hit)
    except (OSError, ValueError, msgpack.UnpackException):
        table = {}
    layout = cache_layout(model_dir)
    table = dict(list(table.items())[-(_MAX_ENTRIES - 1) :])
    table[key] = layout
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_bytes(msgpack.packb(table, use_bin_type=True))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
    return layout
