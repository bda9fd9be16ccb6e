"""Encode and decode mlx-lm prompt caches as safetensors bytes, validating before mlx sees them.

The layout is exactly what `mlx_lm.models.cache.save_prompt_cache` writes (tensor names from
`tree_flatten` of the cache states, class names and scalar markers in `__metadata__`), so an
exported blob is a prompt-cache file mlx-lm loads, and a file mlx-lm wrote decodes here. The
bytes come from a store we do not fully trust (a corrupt or hostile LMDB value), so `decode`
checks every length, offset, dtype and class name in pure Python first and rebuilds the cache
objects itself instead of resolving stored names with `globals()`. The byte layout is checked
in `kvstore.safetensors`, the cache structure here; `kvstore.materialize` then copies the tensors.
"""

from __future__ import annotations

import json
import re
import struct
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import cache as mlc

from kvstore import materialize
from kvstore.errors import ChecksumError, CodecError
from kvstore.safetensors import DTYPES as _DTYPES
from kvstore.safetensors import MAX_HEADER_BYTES, Layout, Tensor, parse_layout, read_scalar
from kvstore.safetensors import is_int as _is_int

__all__ = ["CODEC_VERSION", "MAX_HEADER_BYTES", "cache_classes", "cache_tokens", "decode", "encode"]

CODEC_VERSION: int = 1

_CLASS_NAMES = "KVCache RotatingKVCache QuantizedKVCache ArraysCache ChunkedKVCache CacheList"
ALLOWED_CLASSES: dict[str, type] = {
    n: getattr(mlc, n) for n in (*_CLASS_NAMES.split(), "ConcatenateKVCache")
}

_MAX_DEPTH = 12  # dotted tensor-name depth; bounds CacheList nesting too

_CODE_OF = {mdt: code for code, (_, mdt) in _DTYPES.items()}
# Flattened `[metadata, classes, scalars]` keys other than user metadata ("0.*") and "2.0".
_META_KEY = re.compile(r"1\.(0|[1-9][0-9]{0,5})|2\.([1-9][0-9]{0,5})\.([01])")

# Top-level state arity of each class, as its `state` property returns it.
_ARITY = {
    "KVCache": 3,
    "RotatingKVCache": 6,
    "QuantizedKVCache": 5,
    "ArraysCache": 3,
    "ChunkedKVCache": 5,
    "ConcatenateKVCache": 2,
}


def cache_classes(cache: list) -> list[str]:
    """Top-level class names, as stored in the blob's metadata."""
    return [type(c).__name__ for c in cache]


def cache_tokens(cache: list) -> int | None:
    """How many tokens a prompt cache holds: the offset every offset-keeping layer agrees on
    (ArraysCache state has none), or None when they disagree or no layer keeps one."""
    offsets: set[int] = set()

    def visit(c: Any) -> None:
        if type(c).__name__ == "CacheList":
            for x in c.caches:
                visit(x)
        elif isinstance(getattr(c, "offset", None), int):
            offsets.add(c.offset)

    for c in cache:
        visit(c)
    return offsets.pop() if len(offsets) == 1 else None


def keeps_no_offset(cache: list) -> bool:
    """True when no layer keeps a token offset (a pure state-space model's ArraysCache)."""
    return all(
        keeps_no_offset(list(c.caches)) if type(c).__name__ == "CacheList"
        else not isinstance(getattr(c, "offset", None), int)
        for c in cache
    )  # fmt: skip


def _normalize_one(c: Any) -> Any:
    name = type(c).__name__
    # An exact type match: a subclass stored under its own name would not decode.
    if ALLOWED_CLASSES.get(name) is not type(c):
        raise CodecError(f"encode: unsupported cache class {type(c).__module__}.{name}")
    if name == "CacheList":
        return mlc.CacheList(*(_normalize_one(x) for x in c.caches))
    state = list(c.state)
    # mlx-lm grows these buffers 256 positions at a time; only the first n are real data.
    if name in ("KVCache", "QuantizedKVCache", "ChunkedKVCache") and c.keys is not None:
        n = c.offset - getattr(c, "start_position", 0)
        state[0], state[1] = tree_map(lambda x: x[..., :n, :], (c.keys, c.values))
    state = tree_map(lambda x: mx.contiguous(x) if isinstance(x, mx.array) else x, state)
    return _from_state(name, state)


def _from_state(name: str, state: list) -> Any:
    cls = ALLOWED_CLASSES[name]
    if name == "ConcatenateKVCache" and state[0] is None:
        return cls()  # its state setter cannot take an empty cache
    return cls.from_state(state)


def normalize(cache: list) -> list:
    """Return new cache objects whose state holds only live data, contiguous and evaluated.

    KVCache / QuantizedKVCache / ChunkedKVCache buffers are sliced to their offset (mlx-lm pads
    them with zeros in steps of 256); RotatingKVCache is kept exactly, wrapped or not, since its
    `_idx` points into the ring. The input is not mutated.
    """
    out = [_normalize_one(c) for c in cache]
    mx.eval([v for _, v in tree_flatten([c.state for c in out]) if isinstance(v, mx.array)])
    return out


def _array_entry(a: mx.array) -> tuple[str, list[int], memoryview]:
    code = _CODE_OF.get(a.dtype)
    if code is None:
        raise CodecError(f"encode: dtype {a.dtype} cannot be stored")
    if code == "BF16":
        a = a.view(mx.uint16)
    return code, list(a.shape), memoryview(a)


def _scalar_entry(v: Any) -> tuple[str, str, list[int], memoryview]:
    # Same markers and dtypes as save_prompt_cache: mx.array(int) is int32, mx.array(float) f32.
    if v is None:
        return "none", "F32", [0], memoryview(b"")
    if isinstance(v, str):
        codes = np.array([ord(ch) for ch in v], dtype="<i4")
        return "string", ("I32" if v else "F32"), [len(v)], memoryview(codes)
    if isinstance(v, bool):
        return "scalar", "BOOL", [], memoryview(np.array(v, dtype=np.bool_).reshape(1))
    if isinstance(v, int):
        code = "I32" if -(2**31) <= v < 2**31 else "I64"
        return "scalar", code, [], memoryview(np.array([v], dtype=_DTYPES[code][0]))
    if isinstance(v, float):
        return "scalar", "F32", [], memoryview(np.array([v], dtype="<f4"))
    raise CodecError(f"encode: cache state value {v!r} is not serializable")


def encode(cache: list, metadata: dict[str, str] | None = None) -> bytes:
    """Serialize `cache` to the mlx-lm prompt-cache safetensors layout, in memory.

    `mlx_lm.models.cache.load_prompt_cache` of the bytes written to a `.safetensors` file returns
    equal caches. Calls `normalize` first. Output is deterministic for equal inputs.
    """
    meta = dict(metadata or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CodecError("encode: metadata must map str to str")
    if not cache:
        raise CodecError("encode: empty cache list")
    cache = normalize(cache)
    scalars: list[Any] = [""]  # non-empty so tree_flatten keeps it, as save_prompt_cache does
    entries = []
    for key, leaf in tree_flatten([c.state for c in cache]):
        if isinstance(leaf, mx.array):
            code, shape, payload = _array_entry(leaf)
        else:
            marker, code, shape, payload = _scalar_entry(leaf)
            scalars.append((key, marker))
        entries.append((key, code, shape, payload))
    # Widest items first: every tensor then starts at a multiple of its own item size.
    entries.sort(key=lambda e: (-_DTYPES[e[1]][0].itemsize, e[0]))
    header: dict[str, Any] = {}
    offset = 0
    for key, code, shape, payload in entries:
        header[key] = dict(dtype=code, shape=shape, data_offsets=[offset, offset + payload.nbytes])
        offset += payload.nbytes
    header["__metadata__"] = dict(tree_flatten([meta, cache_classes(cache), scalars]))
    try:
        raw = json.dumps(header, separators=(",", ":"), sort_keys=True, ensure_ascii=False)
        raw_bytes = raw.encode("utf-8")
    except UnicodeEncodeError as e:
        raise CodecError(f"encode: metadata is not valid UTF-8: {e}") from None
    # Pad with spaces (as safetensors does) so the data section starts 8-byte aligned.
    raw_bytes += b" " * (-(8 + len(raw_bytes)) % 8)
    return b"".join([struct.pack("<Q", len(raw_bytes)), raw_bytes, *(e[3] for e in entries)])


def _is_index(p: str) -> bool:
    return p.isascii() and p.isdigit() and len(p) <= 6 and (p == "0" or p[0] != "0")


class _Decoder:
    def __init__(self, blob: bytes | memoryview | bytearray, name: str):
        self.name = name
        try:
            self.mv = memoryview(blob).cast("B")
        except TypeError as e:
            raise self.fail(f"not a contiguous bytes-like object ({e})") from None

    def fail(self, msg: str) -> CodecError:
        return CodecError(f"{self.name}: {msg}")

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
            raise self.fail(f"{cls} state {where} has {len(st)} entries, expected {_ARITY[cls]}")
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

    # -- build ----------------------------------------------------------------------------
    def materialize(self, x: Any, arrays: dict[int, mx.array]) -> Any:
        if isinstance(x, Tensor):
            return arrays[id(x)]
        if isinstance(x, list):
            return [self.materialize(y, arrays) for y in x]
        return x

    def build(self, cls: str, st: list, arrays: dict[int, mx.array]) -> Any:
        if cls == "CacheList":
            return mlc.CacheList(*(self.build(name, sub, arrays) for sub, name in st))
        return _from_state(cls, self.materialize(st, arrays))


def _validate(d: _Decoder) -> tuple[Layout, dict, list[str], list, set[str]]:
    layout = parse_layout(d.mv, d.fail)
    user, classes, markers = d.parse_metadata(layout.metadata)
    leaves: dict[str, Any] = dict(layout.tensors)
    for pos, kind in markers.items():
        if pos not in layout.tensors:
            raise d.fail(f"scalar marker points at missing tensor {pos!r}")
        leaves[pos] = read_scalar(d.mv, layout, pos, kind, d.fail)
    states = d.build_tree(leaves, len(classes))
    for i, (cls, st) in enumerate(zip(classes, states, strict=True)):
        d.check_state(cls, st, str(i))
    return layout, user, classes, states, set(markers)


def decode(
    blob: bytes | memoryview, *, name: str = "blob", checksum: int | None = None
) -> tuple[list, dict[str, str]]:
    """Validate `blob`, then rebuild its cache objects; return (cache, user metadata).

    Every check runs before mlx touches the bytes; any failure raises CodecError whose message
    starts with `name`. With `checksum`, the blob's xxh3-64 must equal it (ChecksumError; it runs
    alongside the copy of a large blob). Arrays are copied out of the blob and evaluated, so the
    caller may free or reuse the buffer afterwards.
    """
    d = _Decoder(blob, name)
    try:
        layout, user, classes, states, scalars = _validate(d)
    except CodecError:
        if checksum is not None and materialize.checksum(d.mv) != checksum:
            raise ChecksumError(f"{name}: blob checksum mismatch") from None  # the root cause
        raise
    keys = [k for k in layout.tensors if k not in scalars]
    arrays, ok = materialize.arrays(d.mv, layout, keys, expect_checksum=checksum)
    if not ok:
        raise ChecksumError(f"{name}: blob checksum mismatch")
    by_id = {id(layout.tensors[k]): a for k, a in arrays.items()}
    cache = [d.build(cls, st, by_id) for cls, st in zip(classes, states, strict=True)]
    return cache, user
