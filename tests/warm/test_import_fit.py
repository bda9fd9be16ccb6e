"""Issue 10 item 6: `kvstore import` takes only files that fit the model's layout.

Before, only the per-layer class names and the token count were compared: KV with other heads,
head dims or dtype (made with another model of the same depth) was stored and served.
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from helpers import import_here
from mlx_lm import load
from mlx_lm.models.cache import KVCache, make_prompt_cache, save_prompt_cache

from kvstore.codec import cache_api
from kvstore.codec.cache_state import ALLOWED_CLASSES
from kvstore.store.store import Store
from kvstore.warm.importfit import ImportMismatch

TOKENS = list(range(3, 23))


@pytest.fixture(scope="module")
def llama_cache(llama_path):
    model, _ = load(str(llama_path))
    cache = make_prompt_cache(model)
    model(mx.array(TOKENS)[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def kv(keys, values) -> KVCache:
    return cache_api.from_state("KVCache", [keys, values, keys.shape[2]], ALLOWED_CLASSES)


def write(tmp_path, cache, *, model) -> tuple:
    file = tmp_path / "cache.safetensors"
    save_prompt_cache(str(file), cache, {"model": str(model), "tokenizer_config": "{}"})
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    return file, tokens


def live(c):
    return c.keys[..., : c.offset, :], c.values[..., : c.offset, :]


def refused(store, file, tokens, model, kv_home, match):
    with pytest.raises(ImportMismatch, match=match):
        import_here(store, file, model=str(model), tokens_file=tokens, home=kv_home)
    assert store.metas() == []  # never a stored entry


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda k, v: (k[:, :1], v[:, :1]), "1 heads of dim 32, float32 in the file, .*2 heads"),
        (lambda k, v: (k[..., :16], v[..., :16]), "heads of dim 16, float32 in the file"),
        (lambda k, v: (k.astype(mx.float16), v.astype(mx.float16)), "float16 in the file"),
    ],
    ids=["kv-heads", "head-dim", "dtype"],
)
def test_kv_of_another_shape_or_dtype_is_refused(
    change, match, llama_cache, llama_path, kv_home, tmp_path
):
    cache = [kv(*change(*live(c))) for c in llama_cache]
    file, tokens = write(tmp_path, cache, model=llama_path)
    with Store(kv_home) as store:
        refused(store, file, tokens, llama_path, kv_home, match)


def test_quantization_mlx_lm_does_not_produce_is_refused(
    llama_cache, llama_path, kv_home, tmp_path
):
    # 1-bit KV packs consistently (the codec takes it), but no kv_bits setting makes it (mlx
    # before 0.32 cannot even quantize to 1 bit: the packed words are made here)
    def one_bit(x):
        b, h, n, d = x.shape
        words = mx.zeros((b, h, n, d // 32), dtype=mx.uint32)
        return [words, mx.ones((b, h, n, d // 32), x.dtype), mx.zeros((b, h, n, d // 32), x.dtype)]

    cache = [
        cache_api.from_state(
            "QuantizedKVCache", [one_bit(k), one_bit(v), k.shape[2], 32, 1], ALLOWED_CLASSES
        )
        for k, v in map(live, llama_cache)
    ]
    file, tokens = write(tmp_path, cache, model=llama_path)
    with Store(kv_home) as store:
        refused(store, file, tokens, llama_path, kv_home, "bits=1")


def test_a_file_made_with_another_model_is_refused(llama_cache, llama_path, kv_home, tmp_path):
    cache = [kv(*live(c)) for c in llama_cache]
    file, tokens = write(tmp_path, cache, model="mlx-community/Qwen3-0.6B-4bit")
    with Store(kv_home) as store:
        refused(store, file, tokens, llama_path, kv_home, "made with model 'mlx-community/Qwen3")


def test_fitting_files_plain_and_quantized_are_stored(llama_cache, llama_path, kv_home, tmp_path):
    for cache in (
        [kv(*live(c)) for c in llama_cache],
        [kv(*live(c)).to_quantized(group_size=32, bits=8) for c in llama_cache],
    ):
        file, tokens = write(tmp_path, cache, model=llama_path)
        with Store(kv_home) as store:
            meta = import_here(store, file, model=str(llama_path), tokens_file=tokens, home=kv_home)
            assert meta.ntokens == len(TOKENS)
    with Store(kv_home) as store:
        assert len(store.metas()) == 2  # one plain, one under the kv_bits=8 fingerprint
