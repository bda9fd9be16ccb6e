"""The mlx-lm cache API of the installed version, and the one form kvstore stores a cache in.

mlx-lm 0.31 and 0.32 save a cache differently:

- 0.31: `state` holds the arrays only; the integers (offsets, sizes) are `meta_state`, a tuple of
  strings; `from_state(state, meta_state)`. The prompt-cache file's metadata is
  `[meta_state of each cache, user metadata, class names]`; no scalar tensors. KVCache /
  ChunkedKVCache rebuild `offset` from the keys' length; ArraysCache's state is its slot list;
  CacheList's meta_state carries its sub-caches' class names and meta_states.
- 0.32: no `meta_state`; `state` holds the arrays and the integers (QuantizedKVCache
  `(keys, values, offset, group_size, bits)`, ArraysCache `(slots, left_padding, lengths)`,
  CacheList `[(state, class name), ...]`, ...); `from_state(state)`. The file's metadata is
  `[user metadata, class names, scalar markers]`, integers, strings and None stored as tensors.

kvstore stores ONE form whatever mlx-lm is installed: the 0.32 one (`FIELDS` below; the codec's
layout), so a store written under either version hydrates under the other. This module is the only
place that knows the installed version: `state` / `from_state` convert between that form and the
installed version's objects, `legacy_states` reads a 0.31 file into it, and `save_file` writes a
file in the installed version's own layout.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlx_lm.models import cache as mlc

from kvstore import mlxlm

# True with mlx-lm 0.31 (`meta_state` and `from_state(state, meta_state)`), False with 0.32.
META_STATE: bool = mlxlm.has_meta_state()

# The stored state of each class, in order: 0.32's `state` tuple, attribute by attribute.
FIELDS: dict[str, tuple[str, ...]] = {
    "KVCache": ("keys", "values", "offset"),
    "RotatingKVCache": ("keys", "values", "offset", "keep", "max_size", "_idx"),
    "QuantizedKVCache": ("keys", "values", "offset", "group_size", "bits"),
    "ArraysCache": ("cache", "left_padding", "lengths"),
    "ChunkedKVCache": ("keys", "values", "offset", "chunk_size", "start_position"),
    "ConcatenateKVCache": ("keys", "values"),
}

# A 0.31 file's meta_state of each class, as the names of stored fields (strings of integers).
_LEGACY_META: dict[str, tuple[str, ...]] = {
    "RotatingKVCache": ("keep", "max_size", "offset", "_idx"),
    "QuantizedKVCache": ("offset", "group_size", "bits"),
    "ChunkedKVCache": ("chunk_size", "start_position"),
}


def state(c: Any) -> list:
    """`c`'s state in the stored form (0.32's `state`), whatever mlx-lm built `c`."""
    name = type(c).__name__
    if name == "CacheList":
        return [[state(x), type(x).__name__] for x in c.caches]
    if not META_STATE:
        return list(c.state)
    return [getattr(c, f) for f in FIELDS[name]]  # 0.32's getters return the attributes as is


def from_state(name: str, st: list, classes: dict[str, type]) -> Any:
    """A cache object of the installed mlx-lm from a state in the stored form; `classes` maps the
    allowed class names to classes (never `globals()` on stored text)."""
    cls: Any = classes[name]
    if name == "CacheList":
        return cls(*(from_state(n, s, classes) for s, n in st))
    if name == "ConcatenateKVCache" and st[0] is None:
        return cls()  # its state setter cannot take an empty cache
    if not META_STATE:
        return cls.from_state(st)
    # 0.31's setters drop what its meta_state does not carry (KVCache's offset is the keys'
    # length): set the attributes 0.32's setter sets, on an object made as from_state makes it.
    obj = mlxlm.new_cache(cls, FIELDS[name], st)
    if name == "ConcatenateKVCache":
        obj.offset = obj.keys.shape[-2]
    return obj


# -- 0.31 prompt-cache files --------------------------------------------------------------------
def is_legacy_file(metadata: dict[str, str]) -> bool:
    """A 0.31 file: its third metadata list is class names, where 0.32's starts with ""."""
    return metadata.get("2.0", "") != ""


def _tree(items: dict[str, str], fail: Callable[[str], Exception]) -> Any:
    root: dict = {}
    for key, value in items.items():
        parts = key.split(".")
        if not all(p.isascii() and p.isdigit() and len(p) <= 6 for p in parts) or len(parts) > 8:
            raise fail(f"unexpected metadata key {key!r}")
        node = root
        for p in parts[:-1]:
            node = node.setdefault(int(p), {})
            if not isinstance(node, dict):
                raise fail(f"metadata key {key!r} collides with a leaf")
        if int(parts[-1]) in node:
            raise fail(f"metadata key {key!r} collides with another entry")
        node[int(parts[-1])] = value

    def listify(n: Any) -> Any:
        if not isinstance(n, dict):
            return n
        if sorted(n) != list(range(len(n))):
            raise fail("metadata lists are not indexed 0..n-1")
        return [listify(n[i]) for i in range(len(n))]

    return listify(root)


def _int(v: Any, fail: Callable[[str], Exception]) -> int:
    if not (isinstance(v, str) and v.isascii() and v.isdigit() and len(v) <= 18):
        raise fail(f"meta_state value {v!r} is not a non-negative integer")
    return int(v)


def _legacy_one(name: str, st: Any, meta: Any, fail: Callable[[str], Exception], depth=0) -> list:
    if name == "CacheList":
        if depth >= 4:
            raise fail("CacheList nested too deeply")
        if not (isinstance(meta, list) and len(meta) == 2 and all(type(m) is list for m in meta)):
            raise fail("CacheList meta_state is not (class names, meta_states)")
        names, metas = meta
        if not isinstance(st, list) or not len(st) == len(names) == len(metas):
            raise fail("CacheList state, class names and meta_states differ in length")
        for n in names:
            if n not in FIELDS and n != "CacheList":
                raise fail(f"cache class {n!r} is not allowed")
        return [
            [_legacy_one(n, s, m, fail, depth + 1), n] for s, n, m in zip(st, names, metas)
        ]  # fmt: skip
    if name not in FIELDS:
        raise fail(f"cache class {name!r} is not allowed")
    if name == "ArraysCache":
        if meta != "" or not isinstance(st, list):
            raise fail("ArraysCache state is not a list of slots")
        return [st, None, None]
    if not (isinstance(st, list) and len(st) == 2):
        raise fail(f"{name} state is not (keys, values)")
    keys, values = st
    fields = _LEGACY_META.get(name, ())
    if fields:
        if not (isinstance(meta, list) and len(meta) == len(fields)):
            raise fail(f"{name} meta_state is not {len(fields)} values")
        got = dict(zip(fields, (_int(m, fail) for m in meta)))
    elif meta != "":
        raise fail(f"{name} has a meta_state")
    else:
        got = {}
    first = keys[0] if isinstance(keys, list) and keys else keys
    shape: tuple[int, ...] = getattr(first, "shape", ())
    held = shape[2] if len(shape) == 4 else 0  # a malformed state fails the codec's checks after
    if name == "KVCache":
        got["offset"] = held  # 0.31 rebuilds the offset from the keys
    elif name == "ChunkedKVCache":
        got["offset"] = got["start_position"] + held
    return [keys, values, *(got[f] for f in FIELDS[name][2:])]


def legacy_states(
    metadata: dict[str, str], tensors: list, fail: Callable[[str], Exception]
) -> tuple[dict[str, str], list[str], list]:
    """A 0.31 file read into the stored form: (user metadata, class names, states).

    `metadata` is the file's flattened `[meta_states, user metadata, class names]`; `tensors` the
    tree of its tensors, one state per cache (leaves as they come: arrays or their descriptions,
    any object with `shape`). Integers come from the meta_states, checked here."""
    user = {k[2:]: v for k, v in metadata.items() if k.startswith("1.")}
    rest = {k: v for k, v in metadata.items() if not k.startswith("1.")}
    rest["1"] = ""  # the user metadata's place, taken out above (its keys may hold dots)
    tree = _tree(rest, fail)
    if len(tree) != 3 or not isinstance(tree[2], list) or not isinstance(tree[0], list):
        raise fail("metadata is neither mlx-lm 0.31's nor 0.32's prompt-cache layout")
    metas, names = tree[0], tree[2]
    if not names or len(metas) != len(names) or len(tensors) > len(names):
        raise fail("class names, meta_states and states differ in number")
    if not all(isinstance(n, str) for n in names):
        raise fail("class names are not strings")
    tensors = list(tensors) + [[]] * (len(names) - len(tensors))
    states = [_legacy_one(n, s, m, fail) for n, s, m in zip(names, tensors, metas)]
    return user, names, states


def save_file(path: Path, cache: list, metadata: dict[str, str]) -> None:
    """Write `cache` as the installed mlx-lm's `save_prompt_cache` does (its own layout)."""
    mlc.save_prompt_cache(str(path), cache, metadata)


__all__ = [
    "FIELDS",
    "META_STATE",
    "from_state",
    "is_legacy_file",
    "legacy_states",
    "save_file",
    "state",
]
