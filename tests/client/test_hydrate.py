"""Hydrated KV equals a fresh prefill, array for array, and a prompt extending a pin prefills only
its suffix with the same logits as a cold run of the same split."""

from __future__ import annotations

import logging

import mlx.core as mx
import pytest
from helpers import assert_same_kv, chat, manifest_for, mlx_lm_prefill, warm_two_pins
from mlx_lm import load
from mlx_lm.models.cache import LRUPromptCache

from kvstore import client
from kvstore.client import PersistentPromptCache, hydrate
from kvstore.kvcheck.prefill import prefill
from kvstore.ops.warm import warm
from kvstore.pins.manifest import load_manifest
from kvstore.store.entry import pack_tokens, packed_prefix_hash
from kvstore.store.store import Store


def test_hydrate_equals_fresh_prefill(any_model_path, kv_home, tmp_path):
    _check_hydrate_equals_fresh_prefill(any_model_path, kv_home, tmp_path, None)


def test_kv_bits_pins_quantize_as_generate_does(llama_path, kv_home, tmp_path):
    # quantized from the first token (quantized_kv_start = 0): QuantizedKVCache entries
    quant = dict(kv_bits=8, kv_group_size=32, quantized_kv_start=0)
    caches = _check_hydrate_equals_fresh_prefill(llama_path, kv_home, tmp_path, quant)
    assert {type(c).__name__ for cache in caches for c in cache} == {"QuantizedKVCache"}


def test_kv_bits_pins_below_quantized_kv_start_stay_full_precision(llama_path, kv_home, tmp_path):
    # mlx-lm's default start (5000 tokens): a cold generate(kv_bits=8) keeps these short
    # prefixes unquantized, so the stored pins must too, under the kv_bits=8 fingerprint
    quant = dict(kv_bits=8, kv_group_size=32, quantized_kv_start=5000)
    caches = _check_hydrate_equals_fresh_prefill(llama_path, kv_home, tmp_path, quant)
    assert {type(c).__name__ for cache in caches for c in cache} == {"KVCache"}


def _check_hydrate_equals_fresh_prefill(any_model_path, kv_home, tmp_path, quant):
    extra = "".join(f"{k} = {v}\n" for k, v in (quant or {}).items())
    metas = warm_two_pins(tmp_path, kv_home, any_model_path, extra)
    model, tokenizer = load(str(any_model_path))
    lru = LRUPromptCache(max_size=10)
    report = hydrate(lru, "m", any_model_path, home=kv_home, model=model, **(quant or {}))
    assert report.warning is None
    assert report.entries == 2
    assert report.tokens == sum(m.ntokens for m in metas.values())
    assert len(lru) == 2

    hydrated = []
    for meta in metas.values():
        tokens = meta.token_ids()
        cache, rest = lru.fetch_nearest_cache("m", tokens)
        assert rest == []
        assert_same_kv(cache, mlx_lm_prefill(model, tokens, quant))
        hydrated.append(cache)

    # a real request continuing the classify pin: only the suffix is prefilled
    system = load_manifest(tmp_path / "manifest.toml").models[0].prefixes[0].messages[0]["content"]
    prompt = chat(tokenizer, system, "My invoice 2291 was charged twice.")
    pin = metas["classify"].token_ids()
    assert prompt[: len(pin)] == pin
    cache, rest = lru.fetch_nearest_cache("m", prompt)
    assert len(rest) == len(prompt) - len(pin)
    hydrated_logits = model(mx.array(rest)[None], cache=cache)
    cold = mlx_lm_prefill(model, pin, quant)
    cold_logits = model(mx.array(rest)[None], cache=cold)
    assert mx.array_equal(hydrated_logits, cold_logits).item()
    return hydrated


def test_hydrate_ignores_other_fingerprints(llama_path, hybrid_path, kv_home, tmp_path):
    warm_two_pins(tmp_path, kv_home, hybrid_path)
    lru = LRUPromptCache()
    report = hydrate(lru, "llama", llama_path, home=kv_home)
    assert report.entries == 0 and len(lru) == 0
    # kv_bits is part of identity: the plain entries are not the quantized model's
    warm_two_pins(tmp_path, kv_home, llama_path)
    report = hydrate(lru, "llama", llama_path, home=kv_home, kv_bits=8)
    assert report.entries == 0 and len(lru) == 0


def test_hydrate_never_raises(llama_path, kv_home, tmp_path, caplog):
    lru = LRUPromptCache()
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        report = hydrate(lru, "m", llama_path, home=tmp_path / "missing-home")
    assert report.entries == 0 and report.warning and "prefilling as usual" in report.warning
    assert sum("not hydrating" in r.message for r in caplog.records) == 1
    report = hydrate(lru, "m", tmp_path / "no-such-model", home=kv_home)
    assert report.entries == 0 and "no-such-model" in report.warning


BAD_ARGUMENTS = [
    ({"home": 123}, "home=123 is not a path"),
    ({"kv_bits": "8"}, "kv_bits: must be an integer, one of 2, 3, 4, 5, 6, 8; got '8' (a string)"),
    ({"adapter_path": 5}, "adapter_path=5 is not a path"),
    ({"model_config": "rope"}, "model_config='rope' is not a dict"),
]


@pytest.mark.parametrize("kwargs, said", BAD_ARGUMENTS)
def test_wrong_argument_types_are_one_warning_in_hydrate_load_and_the_cache(
    kwargs, said, llama_path, kv_home, tmp_path, caplog
):
    """hydrate, kvstore.client.load and PersistentPromptCache never raise (documented): a wrong
    argument
    type is the report's one warning, and the cache still works as a plain LRUPromptCache."""
    warm_two_pins(tmp_path, kv_home, llama_path)
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        report = hydrate(LRUPromptCache(), "m", llama_path, **kwargs)
    assert report.entries == 0 and said in report.warning
    assert sum(said in r.getMessage() for r in caplog.records) == 1
    model, tokenizer = load(str(llama_path))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        with PersistentPromptCache.open(
            model, tokenizer, llama_path, stats=False, **kwargs
        ) as cache:
            assert cache.report.entries == 0 and said in cache.report.warning
            assert cache.fingerprint is None
            pin = cache.pin("p", tokens=[1, 2, 3])
    assert (pin.source, pin.queued) == ("prefill", False)
    assert sum(said in r.getMessage() for r in caplog.records) == 1
    if set(kwargs) & {"adapter_path", "model_config"}:
        return  # mlx_lm.load's own arguments: its own errors
    _, _, cache = client.load(llama_path, stats=False, **kwargs)
    with cache:
        assert cache.report.entries == 0 and said in cache.report.warning


def test_hydrate_into_something_that_is_not_a_prompt_cache_warns(llama_path, kv_home, tmp_path):
    warm_two_pins(tmp_path, kv_home, llama_path)
    report = hydrate(None, "m", llama_path, home=kv_home)
    assert report.entries == 0 and "prompt_cache=None is not an LRUPromptCache" in report.warning


def test_hydrate_reports_lru_overflow(llama_path, kv_home, tmp_path):
    warm_two_pins(tmp_path, kv_home, llama_path)
    lru = LRUPromptCache(max_size=1)
    report = hydrate(lru, "m", llama_path, home=kv_home)
    assert report.entries == 2 and report.dropped == 1
    assert "max_size" in report.warning


def test_hydrated_arrays_survive_store_close_and_rewrite(llama_path, kv_home, tmp_path):
    """mlx is lazy: hydrated arrays must own their bytes, not point into LMDB pages."""
    metas = warm_two_pins(tmp_path, kv_home, llama_path)
    model, _ = load(str(llama_path))
    lru = LRUPromptCache()
    hydrate(lru, "m", llama_path, home=kv_home, model=model)
    with Store(kv_home) as store:  # overwrite the blobs' pages with other data
        store.delete([m.key for m in metas.values()])
        for i in range(8):
            junk = pack_tokens([i])
            store.put(bytes([i]) * 16 + packed_prefix_hash(junk), bytes(2**20), tokens=junk)
    for meta in metas.values():
        tokens = meta.token_ids()
        cache, _ = lru.fetch_nearest_cache("m", tokens)
        assert_same_kv(cache, prefill(model, tokens))


def test_a_model_with_lora_layers_needs_its_adapter_named(llama_path, kv_home, tmp_path):
    from mlx_lm.tuner.utils import linear_to_lora_layers

    warm_two_pins(tmp_path, kv_home, llama_path)
    model, _ = load(str(llama_path))
    linear_to_lora_layers(model, 1, {"rank": 4, "scale": 1.0, "dropout": 0.0})
    lru = LRUPromptCache()
    report = hydrate(lru, "m", llama_path, home=kv_home, model=model)
    assert report.entries == 0 and len(lru) == 0  # base-model KV never goes into an adapted model
    assert "adapter" in report.warning


def test_entries_of_another_model_version_are_named_in_one_warning(llama_path, kv_home, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(llama_path, model)
    warm_two_pins(tmp_path, kv_home, model)
    config = model / "config.json"
    config.write_text(config.read_text().replace("1e-05", "2e-05"))
    report = hydrate(LRUPromptCache(), "m", model, home=kv_home)
    assert report.entries == 0
    assert "2 stored entries" in report.warning and "another version" in report.warning
    assert "(what differs: effective config)" in report.warning


def test_entries_the_lru_cannot_hold_are_named_with_its_max_size(llama_path, kv_home, tmp_path):
    warm_two_pins(tmp_path, kv_home, llama_path)
    report = hydrate(LRUPromptCache(max_size=1), "m", llama_path, home=kv_home)
    assert report.entries == 2 and report.dropped == 1
    assert "(max_size=1, or a longer" in report.warning
    assert "raise max_size to keep them all" in report.warning


def test_a_kv_bits_start_names_kv_quantization_as_what_differs(llama_path, kv_home, tmp_path):
    # issue 43 item 8: it said "weights, config, adapter or KV quantization differ"
    warm_two_pins(tmp_path, kv_home, llama_path)
    report = hydrate(LRUPromptCache(), "m", llama_path, home=kv_home, kv_bits=8)
    assert report.entries == 0 and "another version" in report.warning
    assert "(what differs: KV quantization)" in report.warning
    assert "weights" not in report.warning and "adapter" not in report.warning


def test_kv_bits_of_the_wrong_type_is_named_not_taken_for_another_version(
    llama_path, kv_home, tmp_path
):
    warm_two_pins(tmp_path, kv_home, llama_path, extra="kv_bits = 8")
    report = hydrate(LRUPromptCache(), "m", llama_path, home=kv_home, kv_bits="8")
    assert report.entries == 0 and "another version" not in report.warning
    assert "kv_bits: must be an integer, one of 2, 3, 4, 5, 6, 8; got '8' (a string)" in (
        report.warning
    )
    assert hydrate(LRUPromptCache(), "m", llama_path, home=kv_home, kv_bits=8).entries == 2


def test_one_entry_of_another_model_version_is_worded_in_the_singular(
    llama_path, kv_home, tmp_path
):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(llama_path, model)
    one_pin = '[[model.prefix]]\nname = "c"\nmessages = [{ role = "system", content = "Hi" }]'
    manifest = manifest_for(tmp_path, model, one_pin)
    with Store(kv_home) as store:
        assert warm(load_manifest(manifest), store, home=kv_home).warmed == 1
    config = model / "config.json"
    config.write_text(config.read_text().replace("1e-05", "2e-05"))
    report = hydrate(LRUPromptCache(), "m", model, home=kv_home)
    assert report.entries == 0 and f"1 stored entry for {model}," in report.warning
    assert "were" not in report.warning and "entries" not in report.warning
