"""The cache structure a blob's validated layout names, checked class by class before any array
is built.

Tensor names are dotted index paths into `[state of each cache]`; each class's state must have
its arity, consistent offsets and sizes, and arrays of matching shapes and dtypes. Class names come
from an allowlist, never `globals()[name]` on stored text. Two steps: `header` reads what the
header alone decides (metadata, class names, scalar markers, the state tree with tensors as
leaves; a 0.31 file through `kvstore.codec.cache_api`), `states` reads the scalar values from the
data section and checks every class's state. `rebuild` makes the cache objects at the end.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from mlx_lm.models import cache as mlc

from kvstore.codec import cache_api
from kvstore.codec.safetensors import Layout, Tensor, read_scalar
from kvstore.codec.safetensors import is_int as _is_int
from kvstore.errors import CodecError, counted

_CLASS_NAMES = "KVCache RotatingKVCache QuantizedKVCache ArraysCache ChunkedKVCache CacheList"
ALLOWED_CLASSES: dict[str, type] = {
    n: getattr(mlc, n) for n in (*_CLASS_NAMES.split(), "ConcatenateKVCache")
}

_MAX_DEPTH = 12  # dotted tensor-name depth; bounds CacheList nesting too

# Flattened `[metadata, classes, scalars]` keys other than user metadata ("0.*") and "2.0".
_META_KEY = re.compile(r"1\.(0|[1-9][0-9]{0,5})|2\.([1-9][0-9]{0,5})\.([01])")

# Top-level state arity of each class, in the stored form (mlx-lm 0.32's `state`).
_ARITY = {name: len(fields) for name, fields in cache_api.FIELDS.items()}


def rebuild(name: str, state: list) -> Any:
    """A cache object of the installed mlx-lm, of an allowed class, from its stored state."""
    return cache_api.from_state(name, state, ALLOWED_CLASSES)


def substitute(tree: Any, values: dict[int, Any]) -> Any:
    """`tree` with each Tensor leaf replaced by `values[id(leaf)]` where given (a scalar's value,
    or the mlx array copied out of the blob)."""
    if isinstance(tree, list):
        return [substitute(y, values) for y in tree]
    return values.get(id(tree), tree) if isinstance(tree, Tensor) else tree


class Header(NamedTuple):
    """What a blob's header alone decides: layout, user metadata, classes, scalar markers, and the
    state tree with every tensor (scalars too) as a leaf."""

    layout: Layout
    user: dict[str, str]
    classes: list[str]
    markers: dict[str, str]
    skeleton: list


def _is_index(p: str) -> bool:
    return p.isascii() and p.isdigit() and len(p) <= 6 and (p == "0" or p[0] != "0")


class CacheStateDecoder:
    """Validation of one blob's metadata and state tree; `fail` makes its errors."""

    def __init__(self, blob: bytes | memoryview | bytearray, name: str):
        self.name = name
        try:
            self.mv = memoryview(blob).cast("B")
        except TypeError as e:
            raise self.fail(f"not a contiguous bytes-like object ({e})") from None

    def fail(self, msg: str) -> CodecError:
        return CodecError(f"{self.name}: {msg}")

    # -- the header's structure ----------------------------------------------------------
    def header(self, layout: Layout, legacy: bool = False) -> Header:
        """The structure `layout`'s metadata and tensor names give; `legacy` also takes a file in
        mlx-lm 0.31's layout, read into the stored form (integers from its meta_states)."""
        if legacy and cache_api.is_legacy_file(layout.metadata):
            n = sum(1 for k in layout.metadata if k.startswith("2."))
            tensors = self.build_tree(layout.tensors, n)
            user, classes, states = cache_api.legacy_states(layout.metadata, tensors, self.fail)
            for c in classes:
                self.check_class_name(c)
            return Header(layout, user, classes, {}, states)
        user, classes, markers = self.parse_metadata(layout.metadata)
        for pos in markers:
            if pos not in layout.tensors:
                raise self.fail(f"scalar marker points at missing tensor {pos!r}")
        tree = self.build_tree(layout.tensors, len(classes))
        return Header(layout, user, classes, markers, tree)

    def states(self, header: Header) -> list:
        """Each cache's state with its scalar values read from the data section (numpy, checked),
        every class's state checked; array leaves stay Tensors."""
        layout = header.layout
        values = {
            id(layout.tensors[pos]): read_scalar(self.mv, layout, pos, kind, self.fail)
            for pos, kind in header.markers.items()
        }
        states = substitute(header.skeleton, values)
        for i, (cls, state) in enumerate(zip(header.classes, states, strict=True)):
            self.check_state(cls, state, str(i))
        return states

    # -- metadata -------------------------------------------------------------------------
    def parse_metadata(self, meta: dict[str, str]) -> tuple[dict, list[str], dict[str, str]]:
        user: dict[str, str] = {}
        classes: dict[int, str] = {}
        scalar_parts: dict[int, dict[int, str]] = {}
        for key, value in meta.items():
            m = _META_KEY.fullmatch(key)
            if key.startswith("0."):
                user[key[2:]] = value  # user keys may contain dots; keep them whole
            elif key == "2.0":
                if value != "":
                    raise self.fail("scalar list sentinel '2.0' is not empty")
            elif m is None:
                raise self.fail(f"unexpected metadata key {key!r}")
            elif m[1] is not None:
                classes[int(m[1])] = value
            else:
                scalar_parts.setdefault(int(m[2]), {})[int(m[3])] = value
        if "2.0" not in meta:
            raise self.fail("metadata has no scalar list")
        if not classes or sorted(classes) != list(range(len(classes))):
            raise self.fail("cache class list is missing or not indexed 0..n-1")
        names = [classes[i] for i in range(len(classes))]
        for c in names:
            self.check_class_name(c)
        if sorted(scalar_parts) != list(range(1, len(scalar_parts) + 1)):
            raise self.fail("scalar markers are not indexed 1..n")
        markers: dict[str, str] = {}
        for i in sorted(scalar_parts):
            pair = scalar_parts[i]
            if set(pair) != {0, 1}:
                raise self.fail(f"scalar marker {i} is incomplete")
            pos, kind = pair[0], pair[1]
            if kind not in ("scalar", "string", "none"):
                raise self.fail(f"scalar marker {i} has unknown type {kind!r}")
            if pos in markers:
                raise self.fail(f"tensor {pos!r} has two scalar markers")
            markers[pos] = kind
        return user, names, markers

    def check_class_name(self, c: str) -> None:
        if c not in ALLOWED_CLASSES:
            raise self.fail(f"cache class {c!r} is not allowed")

    # -- state tree -----------------------------------------------------------------------
    def build_tree(self, leaves: dict[str, Any], n_classes: int) -> list:
        root: dict = {}
        for key, value in leaves.items():
            parts = key.split(".")
            if len(parts) > _MAX_DEPTH or not all(map(_is_index, parts)):
                raise self.fail(f"tensor name {key!r} is not a dotted index path")
            node = root
            for p in parts[:-1]:
                node = node.setdefault(int(p), {})
                if not isinstance(node, dict):
                    raise self.fail(f"tensor name {key!r} collides with a leaf")
            if int(parts[-1]) in node:
                raise self.fail(f"tensor name {key!r} collides with another entry")
            node[int(parts[-1])] = value
        if any(i >= n_classes for i in root):
            raise self.fail(f"tensors for cache {max(root)} but only {n_classes} classes")
        return [self.listify(root.get(i, {}), str(i)) for i in range(n_classes)]

    def listify(self, node: Any, where: str) -> Any:
        if not isinstance(node, dict):
            return node
        if sorted(node) != list(range(len(node))):
            raise self.fail(f"state {where} is not indexed 0..{len(node) - 1}")
        return [self.listify(node[i], f"{where}.{i}") for i in range(len(node))]

    # -- per-class consistency ------------------------------------------------------------
    def check_state(self, cls: str, st: Any, where: str, depth: int = 0) -> None:
        if not isinstance(st, list):
            raise self.fail(f"{cls} state {where} is not a list")
        if cls == "CacheList":
            if depth >= 4:
                raise self.fail(f"CacheList {where} nested too deeply")
            for j, pair in enumerate(st):
                if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[1], str)):
                    raise self.fail(f"CacheList {where}.{j} is not a (state, class name) pair")
                self.check_class_name(pair[1])
                self.check_state(pair[1], pair[0], f"{where}.{j}.0", depth + 1)
            return
        if len(st) != _ARITY[cls]:
            has = counted(len(st), "entry")
            raise self.fail(f"{cls} state {where} has {has}, expected {_ARITY[cls]}")
        w = f"{cls} {where}"
        if cls == "ArraysCache":
            slots, *rest = st
            if not isinstance(slots, list):
                raise self.fail(f"{w}: slots are not a list")
            if not all(x is None or isinstance(x, Tensor) for x in (*slots, *rest)):
                raise self.fail(f"{w}: slots must be arrays or none")
            return
        if cls == "ConcatenateKVCache":
            if st != [None, None]:
                self.kv_pair(w, st[0], st[1], 0)
            return
        ints = st[2:]
        if not all(_is_int(x) and x >= 0 for x in ints):
            raise self.fail(f"{w}: offsets and sizes must be non-negative integers, got {ints}")
        need = ints[0]
        if cls == "RotatingKVCache":
            offset, keep, max_size, idx = ints
            if max_size < 1 or keep > max_size:
                raise self.fail(f"{w}: keep {keep} / max_size {max_size} inconsistent")
            need = min(offset, max_size)
        elif cls == "ChunkedKVCache":
            offset, chunk, start = ints
            if chunk < 1 or start > offset:
                raise self.fail(f"{w}: chunk_size {chunk} / start {start} inconsistent")
            need = offset - start
        elif cls == "QuantizedKVCache":
            group, bits = ints[1:]
            if group < 1 or not 1 <= bits <= 8:
                raise self.fail(f"{w}: group_size {group} / bits {bits} invalid")
        if st[0] is None and st[1] is None:
            if ints[0] != 0:
                raise self.fail(f"{w}: empty cache with offset {ints[0]}")
            return
        if cls == "QuantizedKVCache":
            self.quantized_pair(w, st[0], st[1], need, group, bits)
            return
        seq = self.kv_pair(w, st[0], st[1], need)
        if cls == "RotatingKVCache" and idx > seq:
            raise self.fail(f"{w}: ring index {idx} beyond {seq} stored positions")

    def kv_pair(self, w: str, k: Any, v: Any, need: int) -> int:
        if not (isinstance(k, Tensor) and isinstance(v, Tensor)):
            raise self.fail(f"{w}: keys and values must both be arrays")
        if len(k.shape) != 4 or len(v.shape) != 4 or k.shape[:3] != v.shape[:3]:
            raise self.fail(f"{w}: keys {k.shape} / values {v.shape} not matching 4-D arrays")
        if k.code != v.code:
            raise self.fail(f"{w}: keys and values differ in dtype")
        if k.shape[2] < need:
            raise self.fail(f"{w}: {k.shape[2]} stored positions, cache needs {need}")
        return k.shape[2]

    def quantized_pair(self, w: str, k: Any, v: Any, need: int, group: int, bits: int) -> None:
        for part in (k, v):
            if not (isinstance(part, list) and len(part) in (2, 3)):
                raise self.fail(f"{w}: quantized keys/values must be 2 or 3 arrays")
            if not all(isinstance(x, Tensor) and len(x.shape) == 4 for x in part):
                raise self.fail(f"{w}: quantized parts must be 4-D arrays")
            packed, scales = part[0], part[1]
            if packed.code != "U32" or any(x.shape != scales.shape for x in part[1:]):
                raise self.fail(f"{w}: quantized parts have wrong dtype or shapes")
            if packed.shape[:3] != scales.shape[:3] or packed.shape[2] < need:
                raise self.fail(f"{w}: quantized parts hold too few positions")
            if packed.shape[3] * 32 != scales.shape[3] * group * bits:
                raise self.fail(f"{w}: packed width does not match group_size and bits")
