"""Encode and decode mlx-lm prompt caches as safetensors bytes, validating before mlx sees them.

The layout is exactly what mlx-lm 0.32's `save_prompt_cache` writes (tensor names from
`tree_flatten` of the cache states, class names and scalar markers in `__metadata__`), whatever
mlx-lm is installed (`kvstore.codec.cache_api` converts to and from the installed version's
objects), so a store written under mlx-lm 0.31 or 0.32 reads under either. `kvstore import` also
takes 0.31's files (`either_layout`); `kvstore export` writes the installed version's
(kvstore.warm.transfer).

The bytes come from a store we do not fully trust (a corrupt or hostile LMDB value), so `decode`
checks every length, offset, dtype and class name in pure Python first and rebuilds the cache
objects itself instead of resolving stored names with `globals()`. It runs, in order: (a) the byte
layout (`kvstore.codec.safetensors`), (b) the cache structure (`kvstore.codec.cache_state`),
(c) the copy into mlx (`kvstore.codec.materialize`), (d) the cache objects (`cache_state.rebuild`,
through `kvstore.codec.cache_api`).
"""

from __future__ import annotations

import json
import struct
import threading
from collections import OrderedDict
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import cache as mlc

from kvstore import mlxlm
from kvstore.codec import CODEC_VERSION, cache_api, materialize
from kvstore.codec.cache_state import (
    ALLOWED_CLASSES,
    CacheStateDecoder,
    Header,
    rebuild,
    substitute,
)
from kvstore.codec.safetensors import DTYPES as _DTYPES
from kvstore.codec.safetensors import MAX_HEADER_BYTES, parse_layout
from kvstore.errors import ChecksumError, CodecError

__all__ = ["CODEC_VERSION", "MAX_HEADER_BYTES", "cache_classes", "cache_tokens", "decode", "encode"]


_CODE_OF = {mdt: code for code, (_, mdt) in _DTYPES.items()}


def cache_classes(cache: list) -> list[str]:
    """Top-level class names, as stored in the blob's metadata."""
    return [type(c).__name__ for c in cache]


def cache_tokens(cache: list) -> int | None:
    """How many tokens a prompt cache holds: the offset every offset-keeping layer agrees on
    (ArraysCache state has none), or None when they disagree or no layer keeps one."""
    offsets = mlxlm.cache_offsets(cache)
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
    if ALLOWED_CLASSES.get(name) is not (cls := type(c)):
        raise CodecError(f"encode: unsupported cache class {cls.__module__}.{name}")
    if name == "CacheList":
        return mlc.CacheList(*(_normalize_one(x) for x in c.caches))
    state = cache_api.state(c)
    # mlx-lm grows these buffers 256 positions at a time; only the first n are real data.
    if name in ("KVCache", "QuantizedKVCache", "ChunkedKVCache") and c.keys is not None:
        n = c.offset - getattr(c, "start_position", 0)
        state[0], state[1] = tree_map(lambda x: x[..., :n, :], (c.keys, c.values))
    state = tree_map(lambda x: mx.contiguous(x) if isinstance(x, mx.array) else x, state)
    return rebuild(name, state)


def normalize(cache: list) -> list:
    """Return new cache objects whose state holds only live data, contiguous and evaluated.

    KVCache / QuantizedKVCache / ChunkedKVCache buffers are sliced to their offset (mlx-lm pads
    them with zeros in steps of 256); RotatingKVCache is kept exactly, wrapped or not, since its
    `_idx` points into the ring. The input is not mutated.
    """
    out = [_normalize_one(c) for c in cache]
    states = tree_flatten([cache_api.state(c) for c in out])
    mx.eval([v for _, v in states if isinstance(v, mx.array)])
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
    for key, leaf in tree_flatten([cache_api.state(c) for c in cache]):
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


class _Headers:
    """Verdicts on headers already validated. Validating a header ((a) and the header half of
    (b) in `decode`) is a pure function of its bytes and the blob length, so an identical header
    (the same pin hydrated again, or another entry of the same length) reuses the verdict; scalar
    values live in the data section and are read and checked on every decode."""

    MAX = 256

    def __init__(self) -> None:
        self._seen: OrderedDict[tuple[bytes, int, bool], Header] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _key(mv: memoryview, legacy: bool) -> tuple[bytes, int, bool] | None:
        n = int.from_bytes(mv[:8], "little") if len(mv) >= 8 else -1
        return (bytes(mv[: 8 + n]), len(mv), legacy) if 2 <= n <= MAX_HEADER_BYTES else None

    def get(self, mv: memoryview, legacy: bool) -> Header | None:
        key = self._key(mv, legacy)
        with self._lock:
            hit = self._seen.get(key) if key else None
            if hit is not None and key:
                self._seen.move_to_end(key)
            return hit

    def put(self, mv: memoryview, legacy: bool, header: Header) -> None:
        key = self._key(mv, legacy)
        if key is None:
            return  # never read back: `get` has no key for it either
        with self._lock:
            self._seen[key] = header
            if len(self._seen) > self.MAX:
                self._seen.popitem(last=False)


_HEADERS = _Headers()


def _checked(d: CacheStateDecoder, either_layout: bool) -> tuple[Header, list]:
    """Steps (a) and (b) of a decode: the header (remembered per distinct header) and the states
    with their scalar values, every class's state checked; no mlx array is built."""
    header = _HEADERS.get(d.mv, either_layout)
    if header is None:
        # (a) the byte layout: header length, JSON, dtypes, shapes, offsets, exact coverage
        layout = parse_layout(d.mv, d.fail)
        # (b) the cache structure it names: metadata, allowed classes, the state tree
        header = d.header(layout, either_layout)
        _HEADERS.put(d.mv, either_layout, header)
    # (b) continued: the scalar values (data section) and every class's state
    return header, d.states(header)


def validate(blob: bytes | memoryview, *, name: str = "blob") -> tuple[list[str], list]:
    """Check a stored blob as `decode` does, without building arrays (no mlx work): its classes
    and states (scalars read, tensors left as layout entries). Raises CodecError."""
    header, states = _checked(CacheStateDecoder(blob, name), False)
    return list(header.classes), states


def decode(
    blob: bytes | memoryview,
    *,
    name: str = "blob",
    checksum: int | None = None,
    chunk_sums: tuple[int, list[int]] | None = None,
    either_layout: bool = False,
) -> tuple[list, dict[str, str]]:
    """Validate `blob`, then rebuild its cache objects; return (cache, user metadata).

    Every check runs before mlx touches the bytes; any failure raises CodecError whose message
    starts with `name`. With `checksum`, the blob's xxh3-64 must equal it (ChecksumError; it runs
    alongside the copy of a large blob; given the entry's `chunk_sums`, a large blob is checked
    chunk by chunk on the copied bytes instead). Arrays are copied out of the blob and
    evaluated, so the caller may free or reuse the buffer afterwards. The store holds one layout
    (mlx-lm 0.32's); `either_layout` also takes a file mlx-lm 0.31 wrote (`kvstore import`).
    """
    d = CacheStateDecoder(blob, name)
    try:
        header, states = _checked(d, either_layout)
    except CodecError:
        if checksum is not None and materialize.checksum(d.mv) != checksum:
            raise ChecksumError(f"{name}: blob checksum mismatch") from None  # the root cause
        raise
    # (c) materialize: the tensors copied into mlx memory (the checksum alongside)
    layout = header.layout
    keys = [k for k in layout.tensors if k not in header.markers]
    arrays, ok = materialize.arrays(
        d.mv, layout, keys, expect_checksum=checksum, chunk_sums=chunk_sums
    )
    if not ok:
        raise ChecksumError(f"{name}: blob checksum mismatch")
    # (d) rebuild: cache objects of the installed mlx-lm (kvstore.codec.cache_api)
    by_id = {id(layout.tensors[k]): a for k, a in arrays.items()}
    cache = [
        rebuild(cls, substitute(st, by_id)) for cls, st in zip(header.classes, states, strict=True)
    ]
    return cache, dict(header.user)
