"""Prompt-cache files of mlx-lm 0.31 (`[meta_state, metadata, classes]`) and 0.32 (`[metadata,
classes, scalars]`): both import, export writes the layout the installed mlx-lm loads, and the
store holds one form whatever mlx-lm is installed. Runs under either version (`.ci/run` runs it
under both); the 0.31 files are built by hand here, and checked against the installed
`save_prompt_cache` when that is 0.31."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
import xxhash
from helpers import import_here
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

from kvstore.codec import cache_api
from kvstore.codec.cache_state import ALLOWED_CLASSES
from kvstore.codec.codec import decode, encode
from kvstore.codec.safetensors import parse_layout
from kvstore.errors import CodecError, KVStoreError
from kvstore.store.store import Store
from kvstore.warm.transfer import write_file

# xxh3-64 of `encode(fixed_cache(), USER)`: the stored form, the same under mlx-lm 0.31 and 0.32.
STORED_FORM_XXH3 = 11108898834280365702
USER = {"model": "tiny", "tokenizer_config": "{}"}


def ramp(*shape, dtype=mx.float16, start=0):
    n = 1
    for s in shape:
        n *= s
    return (mx.arange(start, start + n, dtype=mx.float32).reshape(shape) / n).astype(dtype)


def build(name, st):
    return cache_api.from_state(name, st, ALLOWED_CLASSES)


def fixed_cache() -> list:
    """One cache of each class, built from the stored form (deterministic, no model)."""
    # 64-dim KV at 8 bits in groups of 32: 16 packed words and 2 scales / biases per row
    q = [
        [mx.arange(i, i + 160, dtype=mx.uint32).reshape(1, 2, 5, 16), ramp(1, 2, 5, 2, start=i),
         ramp(1, 2, 5, 2, start=i + 1)]
        for i in (0, 7)
    ]  # fmt: skip
    return [
        build("KVCache", [ramp(1, 2, 5, 8), ramp(1, 2, 5, 8, start=3), 5]),
        build("RotatingKVCache", [ramp(1, 2, 8, 8), ramp(1, 2, 8, 8, start=1), 11, 2, 8, 5]),
        build("QuantizedKVCache", [list(q[0]), list(q[1]), 5, 32, 8]),
        build(
            "ChunkedKVCache",
            [ramp(1, 2, 3, 8, dtype=mx.float32), ramp(1, 2, 3, 8, dtype=mx.float32), 7, 4, 4],
        ),
        build("ArraysCache", [[ramp(1, 3, 4), ramp(1, 2, 2, dtype=mx.bfloat16)], None, None]),
        build(
            "CacheList",
            [
                [[ramp(1, 1, 2, 4), ramp(1, 1, 2, 4), 2], "KVCache"],
                [[[ramp(1, 5)], None, None], "ArraysCache"],
            ],
        ),
    ]


def _legacy(c) -> tuple:
    """(state, meta_state) as mlx-lm 0.31's `state` / `meta_state` give them."""
    name = type(c).__name__
    if name == "CacheList":
        parts = [_legacy(x) for x in c.caches]
        return [s for s, _ in parts], ([type(x).__name__ for x in c.caches], [m for _, m in parts])
    if name == "ArraysCache":
        return list(c.cache), ""
    k, v = c.keys, c.values
    if name == "QuantizedKVCache":
        k, v = ([x[..., : c.offset, :] for x in y] for y in (k, v))
    elif name in ("KVCache", "RotatingKVCache"):
        k, v = (y[..., : c.offset, :] for y in (k, v))  # a no-op past a wrapped ring's size
    if name == "KVCache":
        return [k, v], ""
    if name == "RotatingKVCache":
        meta = (c.keep, c.max_size, c.offset, c._idx)
    elif name == "QuantizedKVCache":
        meta = (c.offset, c.group_size, c.bits)
    else:
        meta = (c.chunk_size, c.start_position)
    return [k, v], tuple(map(str, meta))


def write_legacy(path, cache, user) -> None:
    """A prompt-cache file as mlx-lm 0.31's save_prompt_cache writes it."""
    parts = [_legacy(c) for c in cache]
    metadata = dict(tree_flatten([[m for _, m in parts], user, [type(c).__name__ for c in cache]]))
    mx.save_safetensors(str(path), dict(tree_flatten([s for s, _ in parts])), metadata)


def stored_states(cache) -> list:
    return tree_flatten([cache_api.state(c) for c in cache])


def assert_same_states(a, b) -> None:
    la, lb = stored_states(a), stored_states(b)
    assert [k for k, _ in la] == [k for k, _ in lb]
    for (key, x), (_, y) in zip(la, lb, strict=True):
        if isinstance(x, mx.array):
            assert x.dtype == y.dtype and x.shape == y.shape and mx.array_equal(x, y).item(), key
        else:
            assert x == y, key


def test_hand_built_files_are_what_the_installed_mlx_lm_writes(tmp_path):
    cache, path = fixed_cache(), tmp_path / "mlx.safetensors"
    save_prompt_cache(str(path), cache, USER)
    theirs = parse_layout(memoryview(path.read_bytes()), ValueError)
    if cache_api.META_STATE:
        write_legacy(tmp_path / "ours.safetensors", cache, USER)
        ours = parse_layout(memoryview((tmp_path / "ours.safetensors").read_bytes()), ValueError)
    else:
        ours = parse_layout(memoryview(encode(cache, USER)), ValueError)
    assert ours.metadata == theirs.metadata
    shapes = {k: (t.code, t.shape) for k, t in ours.tensors.items()}
    assert shapes == {k: (t.code, t.shape) for k, t in theirs.tensors.items()}


def test_both_layouts_decode_to_one_stored_form(tmp_path):
    cache = fixed_cache()
    write_legacy(tmp_path / "031.safetensors", cache, USER)
    legacy = (tmp_path / "031.safetensors").read_bytes()
    blob = encode(cache, USER)
    from_legacy, user = decode(legacy, either_layout=True)
    assert user == USER
    assert_same_states(from_legacy, decode(blob)[0])
    assert_same_states(from_legacy, cache)
    assert encode(from_legacy, user) == blob  # what import stores is the same bytes
    assert decode(blob, either_layout=True)[1] == USER
    with pytest.raises(CodecError, match="unexpected metadata key"):
        decode(legacy)  # a stored blob is only ever the one form


def test_the_stored_form_does_not_depend_on_the_installed_mlx_lm():
    blob = encode(fixed_cache(), USER)
    assert xxhash.xxh3_64_intdigest(blob) == STORED_FORM_XXH3, xxhash.xxh3_64_intdigest(blob)


def test_export_loads_with_the_installed_load_prompt_cache(tmp_path):
    cache, path = fixed_cache(), tmp_path / "export.safetensors"
    write_file(encode(cache, USER), path)
    loaded, user = load_prompt_cache(str(path), return_metadata=True)
    assert user == USER
    if cache_api.META_STATE:
        # mlx-lm 0.31's loader rebuilds a ChunkedKVCache's offset from its keys alone
        assert loaded[3].offset == 3 and loaded[3].start_position == 4
        loaded[3].offset = 7
    assert_same_states(loaded, cache)


@pytest.mark.parametrize("layout", ["0.31", "0.32"])
def test_import_takes_either_layout_and_stores_one_form(layout, llama_path, kv_home, tmp_path):
    model, _ = load(str(llama_path))
    tokens = list(range(3, 40))
    cache = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=cache)
    user = {"model": str(llama_path), "tokenizer_config": "{}"}
    file = tmp_path / "c.safetensors"
    if layout == "0.31":
        write_legacy(file, cache, user)
    else:
        file.write_bytes(encode(cache, user))
    (tmp_path / "t.json").write_text(json.dumps(tokens))
    with Store(kv_home) as store:
        meta = import_here(
            store, file, model=str(llama_path), tokens_file=tmp_path / "t.json", home=kv_home
        )
        assert store.read_blob(meta.key) == encode(cache, user)
        _, stored = store.load(meta.key, meta.tokens)
    assert_same_states(stored, decode(encode(cache))[0])


def test_a_bad_0_31_meta_state_is_refused_in_one_line(llama_path, kv_home, tmp_path):
    cache = fixed_cache()[:2]
    file = tmp_path / "bad.safetensors"
    write_legacy(file, cache, USER)
    layout = parse_layout(memoryview(file.read_bytes()), ValueError)
    metadata = {**layout.metadata, "0.1.2": "eleven"}
    arrays = mx.load(str(file))
    mx.save_safetensors(str(file), arrays, metadata)
    (tmp_path / "t.json").write_text("[1, 2]")
    with Store(kv_home) as store, pytest.raises(KVStoreError) as err:
        import_here(
            store, file, model=str(llama_path), tokens_file=tmp_path / "t.json", home=kv_home
        )
    assert "not a valid prompt-cache file" in str(err.value) and "'eleven'" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "edit",
    [
        {"0.1.2": None},  # a meta_state value missing
        {"2.0": "Foo"},  # a class outside the allowlist
        {"2.5.0": "KVCache"},  # a class name where a string is expected
        {"3.0": "x"},  # a fourth metadata list
        {"0.5.0.0": "CacheList"},  # a CacheList naming itself, with no state
        {"0.1": "", "0.1.0": None, "0.1.1": None, "0.1.2": None, "0.1.3": None},  # no meta_state
        {"0.2.1": "0"},  # a quantized group size of 0
        {"0.0": "7"},  # a KVCache with a meta_state
    ],
)
def test_malformed_0_31_files_are_refused_by_the_codec(edit, tmp_path):
    file = tmp_path / "bad.safetensors"
    write_legacy(file, fixed_cache(), USER)
    metadata = dict(parse_layout(memoryview(file.read_bytes()), ValueError).metadata)
    for k, v in edit.items():
        if v is None:
            metadata.pop(k, None)
        else:
            metadata[k] = v
    mx.save_safetensors(str(file), mx.load(str(file)), metadata)
    with pytest.raises(CodecError):
        decode(file.read_bytes(), either_layout=True)
