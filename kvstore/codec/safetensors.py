"""The safetensors layout of a blob, validated in pure Python before mlx sees a byte of it.

A blob comes from a store we do not fully trust (a corrupt or hostile LMDB value): its header
length, JSON, dtypes, shapes and offsets are all checked here, data bytes must be covered exactly
once, and scalars are read with numpy. Step (a) of `kvstore.codec.codec.decode`;
`kvstore.codec.cache_state` then checks the cache structure and `kvstore.codec.materialize` copies
the tensors into mlx memory.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np

from kvstore.errors import CodecError

MAX_HEADER_BYTES: int = 16 << 20

_MAX_NDIM = 8
_MAX_DIM = 2**31 - 1  # mlx shapes are int32
_MAX_STRING = 4096

# safetensors dtype -> (numpy dtype that moves the bytes, mlx dtype). numpy has no bfloat16, so
# BF16 travels as uint16 and is viewed back in mlx. F64 is left out: mx.array() of a float64
# numpy array silently becomes float32, so it could not round-trip.
DTYPES: dict[str, tuple[np.dtype, mx.Dtype]] = {
    "BOOL": (np.dtype(np.bool_), mx.bool_),
    "U8": (np.dtype("<u1"), mx.uint8),
    "I8": (np.dtype("<i1"), mx.int8),
    "U16": (np.dtype("<u2"), mx.uint16),
    "I16": (np.dtype("<i2"), mx.int16),
    "U32": (np.dtype("<u4"), mx.uint32),
    "I32": (np.dtype("<i4"), mx.int32),
    "U64": (np.dtype("<u8"), mx.uint64),
    "I64": (np.dtype("<i8"), mx.int64),
    "F16": (np.dtype("<f2"), mx.float16),
    "BF16": (np.dtype("<u2"), mx.bfloat16),
    "F32": (np.dtype("<f4"), mx.float32),
}
INT_CODES = {"U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64"}


class Tensor(NamedTuple):
    """A validated tensor entry, not yet copied out of the blob (offsets relative to the data)."""

    code: str
    shape: tuple[int, ...]
    begin: int
    end: int


class Layout(NamedTuple):
    tensors: dict[str, Tensor]
    metadata: dict[str, str]
    data_start: int  # byte offset of the data section in the blob


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        # Parsers disagree on which duplicate wins; refuse the ambiguity.
        keys = [k for k, _ in pairs]
        raise ValueError(f"duplicate keys {sorted({k for k in keys if keys.count(k) > 1})}")
    return d


def _reject_constant(s: str) -> Any:
    raise ValueError(f"non-standard JSON constant {s}")


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_layout(mv: memoryview, fail: Callable[[str], CodecError]) -> Layout:
    """Header length, JSON, every tensor entry, and exact coverage of the data section."""
    total = len(mv)
    if total < 8:
        raise fail(f"truncated: {total} bytes, less than the 8-byte header length")
    n = int.from_bytes(mv[:8], "little")
    if not 2 <= n <= MAX_HEADER_BYTES:
        raise fail(f"header length {n} outside [2, {MAX_HEADER_BYTES}]")
    if 8 + n > total:
        raise fail(f"header length {n} runs past the end of the {total}-byte blob")
    try:
        text = bytes(mv[8 : 8 + n]).decode("utf-8")
        header = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise fail(f"header is not UTF-8 JSON: {e}") from None
    if not isinstance(header, dict):
        raise fail("header is not a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise fail("__metadata__ is not an object of strings")
    data_len = total - 8 - n
    tensors = {k: _tensor_entry(k, v, data_len, fail) for k, v in header.items()}
    spans = sorted((t.begin, t.end, k) for k, t in tensors.items() if t.end > t.begin)
    covered = prev_end = 0
    prev_key = None
    for begin, end, key in spans:
        if begin < prev_end:
            raise fail(f"tensors {prev_key!r} and {key!r} overlap")
        prev_end, prev_key = end, key
        covered += end - begin
    if covered != data_len:
        raise fail(f"{data_len - covered} data bytes are not covered by any tensor")
    return Layout(tensors, meta, 8 + n)


def _tensor_entry(key: str, e: Any, data_len: int, fail: Callable[[str], CodecError]) -> Tensor:
    if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
        raise fail(f"tensor {key!r}: entry must have exactly dtype, shape, data_offsets")
    code, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
    if not isinstance(code, str) or code not in DTYPES:
        raise fail(f"tensor {key!r}: dtype {code!r} not allowed")
    if not isinstance(shape, list) or len(shape) > _MAX_NDIM:
        raise fail(f"tensor {key!r}: shape must be a list of at most {_MAX_NDIM} dims")
    if not all(is_int(d) and 0 <= d <= _MAX_DIM for d in shape):
        raise fail(f"tensor {key!r}: shape {shape} has a negative or oversized dim")
    if not (isinstance(offs, list) and len(offs) == 2 and all(is_int(o) for o in offs)):
        raise fail(f"tensor {key!r}: data_offsets must be two integers")
    begin, end = offs
    if not 0 <= begin <= end <= data_len:
        raise fail(f"tensor {key!r}: data_offsets {offs} outside [0, {data_len}]")
    size = DTYPES[code][0].itemsize
    for d in shape:
        size *= d  # dims are <= 2**31 and ndim <= 8: no runaway big-int work
    if size != end - begin:
        raise fail(f"tensor {key!r}: shape {shape} needs {size} bytes, offsets span {end - begin}")
    return Tensor(code, tuple(shape), begin, end)


def read_scalar(
    mv: memoryview, layout: Layout, key: str, kind: str, fail: Callable[[str], CodecError]
) -> Any:
    """A scalar, string or none marker's value, read with numpy (mlx has not seen the bytes)."""
    t = layout.tensors[key]
    count = (t.end - t.begin) // DTYPES[t.code][0].itemsize
    if kind == "none":
        if count:
            raise fail(f"tensor {key!r} is marked none but holds data")
        return None
    if kind == "string" and count == 0:
        return ""
    if t.code == "BF16" or (kind == "scalar" and count != 1):
        raise fail(f"tensor {key!r} is not a valid scalar")
    if kind == "string" and (t.code not in INT_CODES or len(t.shape) != 1 or count > _MAX_STRING):
        raise fail(f"tensor {key!r} is not a valid string")
    vals = np.frombuffer(mv, DTYPES[t.code][0], count, layout.data_start + t.begin)
    if kind == "scalar":
        return vals[0].item()
    codes = vals.tolist()
    if not all(0 <= ch <= 0x10FFFF for ch in codes):
        raise fail(f"tensor {key!r} holds an invalid code point")
    return "".join(map(chr, codes))
