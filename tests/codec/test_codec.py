"""kvstore.codec.codec: round trips of every cache family, mlx-lm compatibility, validation."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers import states
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    RotatingKVCache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
)

from kvstore.codec import cache_api, materialize
from kvstore.codec.codec import ALLOWED_CLASSES, cache_classes, decode, encode, normalize
from kvstore.errors import CodecError
from kvstore.warm.transfer import write_file

_KEY = mx.random.key(7)


def rand(n: int, dtype=mx.float16, heads: int = 2, dim: int = 64, seed: int = 0) -> mx.array:
    x = mx.random.normal((1, heads, n, dim), key=mx.random.key(seed + 1000 * n))
    return x.astype(dtype)


def feed(c, n: int, dtype=mx.float16, seed: int = 0, dim: int = 64):
    keys, values = rand(n, dtype, seed=seed, dim=dim), rand(n, dtype, seed=seed + 1, dim=dim)
    return c.update_and_fetch(keys, values)


def assert_same(a: list, b: list) -> None:
    """Same classes, same flattened state: arrays equal in dtype, shape and every element."""
    assert cache_classes(a) == cache_classes(b)
    la = tree_flatten([cache_api.state(c) for c in a])
    lb = tree_flatten([cache_api.state(c) for c in b])
    assert [k for k, _ in la] == [k for k, _ in lb]
    for (key, x), (_, y) in zip(la, lb, strict=True):
        if isinstance(x, mx.array):
            assert isinstance(y, mx.array), key
            assert (x.dtype, x.shape) == (y.dtype, y.shape), key
            assert mx.array_equal(x, y).item(), key
        else:
            assert type(x) is type(y) and x == y, key


def roundtrip(cache: list, metadata: dict[str, str] | None = None) -> list:
    out, meta = decode(encode(cache, metadata))
    assert meta == (metadata or {})
    assert_same(normalize(cache), out)
    return out


# -- round trips of each family ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_kvcache_roundtrip_is_sliced_to_offset(dtype):
    c = KVCache()
    feed(c, 37, dtype)
    for i in range(3):
        feed(c, 1, dtype, seed=i + 1)
    assert c.keys.shape[2] == 256  # mlx-lm's step padding, which must not be stored
    (out,) = roundtrip([c])
    assert out.offset == 40 and out.keys.shape[2] == 40 and out.keys.dtype == dtype
    k, v = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
    assert mx.array_equal(out.keys, k).item() and mx.array_equal(out.values, v).item()


def test_empty_caches_roundtrip():
    trimmed = KVCache()
    feed(trimmed, 5)
    trimmed.trim(5)
    out = roundtrip([KVCache(), ArraysCache(2), ConcatenateKVCache(), trimmed])
    assert out[0].keys is None and out[0].offset == 0 and out[1].cache == [None, None]
    assert out[3].keys.shape == (1, 2, 0, 64)  # a zero-size tensor, not a none marker


def test_trimmed_kvcache_continues_like_the_original():
    c = KVCache()
    feed(c, 50, mx.bfloat16)
    c.trim(10)
    (out,) = roundtrip([c])
    assert out.offset == 40
    for step, n in enumerate((5, 1, 300)):
        ka, va = feed(c, n, mx.bfloat16, seed=10 + step)
        kb, vb = feed(out, n, mx.bfloat16, seed=10 + step)
        assert mx.array_equal(ka, kb).item() and mx.array_equal(va, vb).item()


@pytest.mark.parametrize("wrapped", [False, True])
def test_rotating_kvcache_roundtrip_and_continue(wrapped):
    c = RotatingKVCache(max_size=16, keep=4) if wrapped else RotatingKVCache(max_size=64)
    for i, n in enumerate((13, 17, 7) if wrapped else (20,)):
        feed(c, n, seed=i)
    for i in range(5):
        feed(c, 1, seed=100 + i)
    assert (c.offset > c.max_size) is wrapped
    (out,) = roundtrip([c])
    assert (out.offset, out._idx, out.keep, out.max_size) == (c.offset, c._idx, c.keep, c.max_size)
    for i, n in enumerate((1, 1, 3)):
        ka, va = feed(c, n, seed=200 + i)
        kb, vb = feed(out, n, seed=200 + i)
        assert mx.array_equal(ka, kb).item() and mx.array_equal(va, vb).item()


@pytest.mark.parametrize(("group_size", "bits"), [(64, 8), (32, 4)])
def test_quantized_kvcache_roundtrip(group_size, bits):
    c = KVCache()
    feed(c, 45)
    q = c.to_quantized(group_size=group_size, bits=bits)
    (out,) = roundtrip([q])
    assert (out.offset, out.group_size, out.bits) == (45, group_size, bits)
    assert out.keys[0].shape[2] == 45
    ka, _ = feed(q, 1, seed=3)
    kb, _ = feed(out, 1, seed=3)
    assert all(mx.array_equal(x, y).item() for x, y in zip(ka, kb, strict=True))


def test_arrays_cache_with_empty_slot():
    c = ArraysCache(3)
    c[0] = mx.random.normal((1, 3, 8), key=_KEY)
    c[2] = mx.random.normal((1, 4, 2, 2), key=_KEY).astype(mx.bfloat16)
    (out,) = roundtrip([c])
    assert out.cache[1] is None and isinstance(out.cache, list)
    c.left_padding, c.lengths = mx.array([2]), mx.array([5])
    roundtrip([c])


def test_chunked_kvcache_roundtrip():
    # 18 positions trimmed off the front of 53 (mlx-lm 0.31's maybe_trim_front miscounts a padded
    # buffer, so the cache is built from its stored form)
    keys, values = rand(35, mx.float32), rand(35, mx.float32, seed=1)
    c = cache_api.from_state("ChunkedKVCache", [keys, values, 53, 32, 18], ALLOWED_CLASSES)
    (out,) = roundtrip([c])
    assert (out.offset, out.start_position, out.chunk_size) == (53, 18, 32)
    ka, _ = feed(c, 2, mx.float32, seed=2)
    kb, _ = feed(out, 2, mx.float32, seed=2)
    assert mx.array_equal(ka, kb).item()


def test_cache_list_and_metadata():
    inner = ArraysCache(2)
    inner[1] = mx.ones((1, 2, 3))
    cl = CacheList(KVCache(), inner)
    feed(cl[0], 9)
    concat = ConcatenateKVCache()
    feed(concat, 6)
    meta = {"label": "classify", "dotted.key": "ünïcode ✓", "": "empty key"}
    out = roundtrip([cl, concat, KVCache()], meta)
    assert isinstance(out[0], CacheList) and isinstance(out[0][1], ArraysCache)
    assert out[1].offset == 6


def test_normalize_does_not_mutate():
    c = KVCache()
    feed(c, 10)
    (n,) = normalize([c])
    assert c.keys.shape[2] == 256 and n.keys.shape[2] == 10 and n is not c


def test_encode_rejects_unknown_classes_and_bad_metadata():
    class MyCache(KVCache):
        pass

    with pytest.raises(CodecError, match="unsupported cache class"):
        encode([MyCache()])
    with pytest.raises(CodecError, match="metadata"):
        encode([KVCache()], {"a": 1})  # type: ignore[dict-item]


# -- real models ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from mlx_lm.utils import load_model

    from kvstore.tiny import make_tiny_model

    models = {}
    for arch in ("llama", "qwen3_5", "gemma3_text"):
        path = make_tiny_model(tmp_path_factory.mktemp(arch), arch)
        models[arch] = load_model(Path(path))[0]
    return models


@pytest.mark.parametrize("arch", ["llama", "qwen3_5", "gemma3_text"])
def test_real_model_prefill_roundtrip(tiny_models, arch):
    model = tiny_models[arch]
    rng = np.random.default_rng(1)
    tokens = rng.integers(3, 500, size=80).tolist()  # past gemma3's 64-token window
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(tokens)[None], cache=cache))
    out = roundtrip(cache)
    for tok in (17, 42):  # two steps: the second runs on a ring that already rotated
        step = mx.array([[tok]])
        a, b = model(step, cache=cache), model(step, cache=out)
        assert mx.array_equal(a, b).item()


# -- compatibility with mlx-lm's own files -------------------------------------------------------


def mixed_cache() -> list:
    kv, rot, chunk = KVCache(), RotatingKVCache(max_size=16, keep=2), ChunkedKVCache(8)
    feed(kv, 21, mx.bfloat16)
    for i, n in enumerate((12, 9, 1, 1)):
        feed(rot, n, seed=i)
    feed(chunk, 5, mx.float32)
    q = KVCache()
    feed(q, 7)
    arrays = ArraysCache(2)
    arrays[0] = mx.arange(12, dtype=mx.float32).reshape(1, 3, 4)
    arrays[1] = mx.ones((1, 2, 2), dtype=mx.bfloat16)  # mlx-lm 0.31 cannot save an empty slot
    inner, inner_arrays = KVCache(), ArraysCache(1)
    feed(inner, 3, dim=8)
    inner_arrays[0] = mx.zeros((1, 5))
    return [
        kv,
        rot,
        chunk,
        q.to_quantized(group_size=32, bits=8),
        arrays,
        CacheList(inner, inner_arrays),
    ]


def test_encoded_bytes_load_with_mlx_lm(tmp_path):
    cache = mixed_cache()
    path = tmp_path / "c.safetensors"
    write_file(encode(cache, {"model": "tiny"}), path)  # as `kvstore export` writes it
    loaded, meta = load_prompt_cache(str(path), return_metadata=True)
    assert meta == {"model": "tiny"}
    assert_same(normalize(cache), loaded)


def test_mlx_lm_files_decode(tmp_path):
    cache = mixed_cache()
    path = tmp_path / "c.safetensors"
    save_prompt_cache(str(path), cache, {"k": "v"})
    out, meta = decode(path.read_bytes(), name=str(path), either_layout=True)
    assert meta == {"k": "v"}
    assert_same(load_prompt_cache(str(path)), out)


def test_decoded_arrays_do_not_alias_the_blob():
    cache = mixed_cache()
    buf = bytearray(encode(cache))
    out, _ = decode(buf)
    out_view, _ = decode(memoryview(buf))
    buf[:] = bytes(len(buf))
    assert_same(normalize(cache), out)
    assert_same(normalize(cache), out_view)


# -- validation ----------------------------------------------------------------------------------


def split(blob: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def join(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def small_blob() -> bytes:
    kv = KVCache()
    feed(kv, 3, dim=4)
    inner = KVCache()
    feed(inner, 2, mx.bfloat16, dim=4)
    return encode([kv, CacheList(inner, ArraysCache(1))], {"label": "x"})


def edit(fn):
    """A bad blob made by editing the parsed header (and optionally the data) of a good one."""

    def make() -> bytes:
        header, data = split(small_blob())
        result = fn(header, data)
        return join(header, data) if result is None else join(*result)

    return make


def with_string_tensor(header: dict, data: bytes, key: str, text: str) -> tuple[dict, bytes]:
    """Replace tensor `key` by the code points of `text`, as save_prompt_cache stores strings."""
    tensors = {
        k: (v["dtype"], v["shape"], data[slice(*v["data_offsets"])])
        for k, v in header.items()
        if k != "__metadata__"
    }
    tensors[key] = ("I32", [len(text)], np.array([ord(ch) for ch in text], "<i4").tobytes())
    out, blob = {"__metadata__": header["__metadata__"]}, b""
    for k, (code, shape, raw) in tensors.items():
        out[k] = {"dtype": code, "shape": shape, "data_offsets": [len(blob), len(blob) + len(raw)]}
        blob += raw
    return out, blob


def set_meta(key: str, value):
    return edit(lambda h, d: h["__metadata__"].update({key: value}))


def set_scalar(key: str, value: int):
    def fn(header, data):
        b, e = header[key]["data_offsets"]
        return header, data[:b] + struct.pack("<i", value) + data[e:]

    return fn


def mark_offset_none(header, data):
    meta = header["__metadata__"]
    (key,) = [k for k, v in meta.items() if v == "0.2"]
    meta[key[:-1] + "1"] = "none"


BAD_BLOBS = {
    "truncated": (lambda: small_blob()[:5], "truncated"),
    "short data": (lambda: small_blob()[:-1], "outside|not covered"),
    "header length 0": (lambda: struct.pack("<Q", 0) + small_blob()[8:], "header length"),
    "header length 7": (lambda: struct.pack("<Q", 7) + small_blob()[8:], "JSON"),
    "header length 2**63": (lambda: struct.pack("<Q", 2**63) + small_blob()[8:], "header length"),
    "header past end": (lambda: struct.pack("<Q", 10**6) + small_blob()[8:], "past the end"),
    "not json": (lambda: struct.pack("<Q", 9) + b"{not json", "JSON"),
    "not utf8": (lambda: struct.pack("<Q", 3) + b'"\xff"', "UTF-8"),
    "not an object": (lambda: struct.pack("<Q", 2) + b"[]", "not a JSON object"),
    "deep json": (lambda: struct.pack("<Q", 200000) + b"[" * 200000, "JSON"),
    "trailing bytes": (lambda: small_blob() + b"\0" * 8, "not covered"),
    "unknown dtype": (edit(lambda h, d: h["0.0"].update(dtype="F64")), "dtype"),
    "made-up dtype": (edit(lambda h, d: h["0.0"].update(dtype="PICKLE")), "dtype"),
    "negative shape": (edit(lambda h, d: h["0.0"].update(shape=[1, 2, -3, 4])), "shape"),
    "float shape": (edit(lambda h, d: h["0.0"].update(shape=[1, 2, 3.0, 4])), "shape"),
    "size mismatch": (edit(lambda h, d: h["0.0"].update(shape=[1, 2, 2, 4])), "needs"),
    "overlap": (
        edit(lambda h, d: h["0.1"].update(data_offsets=h["0.0"]["data_offsets"])),
        "overlap|not covered",
    ),
    "offsets out of bounds": (
        edit(lambda h, d: h["0.0"].update(data_offsets=[len(d) - 4, len(d) + 44])),
        "outside",
    ),
    "negative offsets": (edit(lambda h, d: h["0.0"].update(data_offsets=[-48, 0])), "outside"),
    "extra entry field": (edit(lambda h, d: h["0.0"].update(extra=1)), "exactly"),
    "non-string metadata": (set_meta("0.n", 5), "strings"),
    "unexpected metadata": (set_meta("9", "x"), "unexpected"),
    "class os.system": (
        set_meta("1.0", "os.system"),
        "not allowed",
    ),
    "class Path": (set_meta("1.1", "Path"), "not allowed"),
    "nested class": (edit(lambda h, d: with_string_tensor(h, d, "1.0.1", "Path")), "not allowed"),
    "nested class eval": (
        edit(lambda h, d: with_string_tensor(h, d, "1.1.1", "__import__('os')")),
        "not allowed",
    ),
    "bad scalar marker": (
        set_meta("2.1.1", "pickle"),
        "unknown type",
    ),
    "marker to nowhere": (set_meta("2.1.0", "7.7"), "missing"),
    "wrong arity": (
        set_meta("1.0", "RotatingKVCache"),
        "entries",
    ),
    "offset past keys": (edit(set_scalar("0.2", 4)), "stored positions"),
    "negative offset": (edit(set_scalar("0.2", -1)), "non-negative"),
    "none with data": (edit(mark_offset_none), "marked none"),
    "bad tensor name": (edit(lambda h, d: h.update({"0.x": h.pop("0.1")})), "dotted index"),
    "leading zero name": (edit(lambda h, d: h.update({"00.1": h.pop("0.1")})), "dotted index"),
    "class index gap": (set_meta("1.5", "KVCache"), "indexed"),
}


@pytest.mark.parametrize("case", sorted(BAD_BLOBS))
def test_bad_blobs_raise_codec_error(case):
    make, pattern = BAD_BLOBS[case]
    blob = make()
    with pytest.raises(CodecError, match=pattern) as err:
        decode(blob, name="entry-abc")
    assert str(err.value).startswith("entry-abc: ")


def test_duplicate_json_keys_rejected():
    header, data = split(small_blob())
    raw = json.dumps(header).encode()
    raw = raw.replace(b'"__metadata__":', b'"__metadata__": {}, "__metadata__":', 1)
    with pytest.raises(CodecError, match="duplicate"):
        decode(struct.pack("<Q", len(raw)) + raw + data)


def test_allowed_classes_are_mlx_lm_classes():
    import mlx_lm.models.cache as mlc

    assert all(getattr(mlc, n) is c for n, c in ALLOWED_CLASSES.items())


_VALID = small_blob()
_VALID_SUM = materialize.checksum(_VALID)


def _contents(cache: list) -> list[tuple[str, tuple, str, bytes]]:
    """Each array of a decoded cache, in order: its layer's class, shape, dtype and bytes."""
    return [
        (type(c).__name__, tuple(a.shape), str(a.dtype), np.array(a.astype(mx.float32)).tobytes())
        for c in _layers(cache)
        for a in states([c])
    ]


def _layers(cache: list) -> list:
    return [x for c in cache for x in (_layers(c.caches) if isinstance(c, CacheList) else [c])]


_ORIGINAL = _contents(decode(_VALID)[0])


def _structure(contents: list) -> list:
    return [item[:3] for item in contents]


@settings(
    derandomize=True, max_examples=300, deadline=None, suppress_health_check=list(HealthCheck)
)
@given(
    cut=st.none() | st.integers(0, len(_VALID)),
    edits=st.lists(st.tuples(st.integers(0, len(_VALID) - 1), st.integers(0, 255)), max_size=4),
    insert=st.none() | st.tuples(st.integers(0, len(_VALID)), st.binary(min_size=1, max_size=8)),
)
def test_byte_mutations_decode_or_raise_codec_error(cut, edits, insert):
    """A mutated blob raises CodecError or decodes to the original's structure (classes, shapes,
    dtypes: what validation guards; the values are the checksum's). With the checksum the store
    records, it raises CodecError unless the bytes are the original's, and then decodes to exactly
    the original."""
    blob = bytearray(_VALID)
    for pos, value in edits:
        blob[pos] = value
    if insert is not None:
        blob[insert[0] : insert[0]] = insert[1]
    if cut is not None:
        del blob[cut:]
    blob = bytes(blob)
    try:
        contents = _contents(decode(blob)[0])
    except CodecError:
        pass
    else:
        assert _structure(contents) == _structure(_ORIGINAL)
    if blob == _VALID:
        assert _contents(decode(blob, checksum=_VALID_SUM)[0]) == _ORIGINAL
    else:
        with pytest.raises(CodecError):
            decode(blob, checksum=_VALID_SUM)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=8,
)


@settings(
    derandomize=True, max_examples=200, deadline=None, suppress_health_check=list(HealthCheck)
)
@given(
    which=st.integers(0, 10**6),
    field=st.sampled_from(["dtype", "shape", "data_offsets", None]),
    value=_JSON,
)
def test_header_mutations_decode_or_raise_codec_error(which, field, value):
    """A header edited to any JSON value raises CodecError, or decodes to exactly the original
    arrays (the edit left the field as it was, or changed free-text user metadata)."""
    header, data = split(_VALID)
    keys = sorted(header)
    key = keys[which % len(keys)]
    if key == "__metadata__":
        meta = header[key]
        mkeys = sorted(meta)
        meta[mkeys[which % len(mkeys)]] = value if isinstance(value, str) else json.dumps(value)
    elif field is None:
        header[key] = value
    else:
        header[key][field] = value
    try:
        cache, _ = decode(join(header, data))
    except CodecError:
        return
    assert _contents(cache) == _ORIGINAL
