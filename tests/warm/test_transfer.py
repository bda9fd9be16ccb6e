"""`kvstore import` of hybrid and sliding-window caches (the first layer keeps no offset)."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from helpers import assert_same_kv, import_here
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache

from kvstore.store.store import Store


@pytest.mark.parametrize("arch", ["hybrid", "sliding"])
def test_import_takes_hybrid_and_sliding_caches(arch, hybrid_path, sliding_path, kv_home, tmp_path):
    path = hybrid_path if arch == "hybrid" else sliding_path
    model, _ = load(str(path))
    tokens = list(range(3, 3 + 90))  # past the tiny gemma's 64-token window
    cache = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=cache)
    mx.eval([c.state for c in cache])
    file = tmp_path / "cache.safetensors"
    save_prompt_cache(str(file), cache, {"model": str(path), "tokenizer_config": "{}"})
    (tmp_path / "tokens.json").write_text(json.dumps(tokens))
    with Store(kv_home) as store:
        meta = import_here(store, file, model=str(path), tokens_file=tmp_path / "tokens.json",
                           home=kv_home)  # fmt: skip
        _, stored = store.load(meta.key, meta.tokens)
    assert meta.ntokens == 90
    assert_same_kv(stored, cache)
