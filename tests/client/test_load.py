"""kvstore.client.load: the model and tokenizer mlx_lm.load gives, and a PersistentPromptCache
hydrated on a second thread while the weights loaded, equal to a fresh prefill; the thread is gone
afterwards, and a process that used it exits cleanly."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import mlx.core as mx
import mlx_lm
import pytest
from helpers import assert_same_kv, mlx_lm_prefill, warm_two_pins
from mlx_lm import load as mlx_load

from kvstore import client
from kvstore.identity.fingerprint import model_fingerprint

LOAD_MODULE = sys.modules["kvstore.client.load"]  # `kvstore.client.load` is the function
HYDRATE_MODULE = sys.modules["kvstore.client.hydrate"]
LOADER_MODULE = sys.modules["kvstore.client.loader"]


@pytest.mark.parametrize(
    "overlap, idle, reader",
    [
        (True, None, "kvstore-prefetch"),
        (False, None, "MainThread"),
        (None, "2", "kvstore-prefetch"),  # by default: beside the load only on an idle core
        (None, "0", "MainThread"),
    ],
)
def test_load_returns_a_cache_hydrated_while_the_weights_loaded(
    overlap, idle, reader, hybrid_path, kv_home, tmp_path, monkeypatch
):
    metas = warm_two_pins(tmp_path, kv_home, hybrid_path)
    seen: list[str] = []
    real = LOAD_MODULE.prefetch

    def spy(*a, **k):
        seen.append(threading.current_thread().name)
        return real(*a, **k)

    fingerprints = []
    for module in (HYDRATE_MODULE, LOADER_MODULE):
        counted = module.model_fingerprint
        monkeypatch.setattr(
            module,
            "model_fingerprint",
            lambda *a, _f=counted, **k: fingerprints.append(1) or _f(*a, **k),
        )
    if idle is not None:
        monkeypatch.setenv("KVSTORE_IDLE_CORES", idle)
    monkeypatch.setattr(LOAD_MODULE, "prefetch", spy)
    model, tokenizer, cache = client.load(hybrid_path, home=kv_home, stats=False, overlap=overlap)
    try:
        assert seen == [reader]  # read once, beside the load or after it
        assert fingerprints == [1]  # the files' fingerprint, taken once before the load
        assert cache.report.warning is None and cache.report.entries == 2
        fp = model_fingerprint(hybrid_path, model_object=model)  # layout from the loaded model
        assert cache.fingerprint == fp.digest
        reference, _ = mlx_load(str(hybrid_path))
        for meta in metas.values():
            kv, rest = cache.fetch_nearest_cache(str(hybrid_path), meta.token_ids())
            assert rest == []
            assert_same_kv(kv, mlx_lm_prefill(reference, meta.token_ids()))
        assert tokenizer.encode("hello") == mlx_load(str(hybrid_path))[1].encode("hello")
    finally:
        cache.close()
    assert not [t for t in threading.enumerate() if t.name == "kvstore-prefetch"]


@pytest.mark.parametrize("overlap", [True, False])
def test_load_hydrates_nothing_when_the_weights_change_while_they_load(
    overlap, model_copy, kv_home, tmp_path, monkeypatch
):
    """Read beside the load or after it: entries of the files as they were when load started
    are never filed for weights read from changed files."""
    warm_two_pins(tmp_path, kv_home, model_copy)
    real = mlx_lm.load

    def load_during_an_update(path, *a, **kw):
        weights = model_copy / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[len(data) // 2] ^= 0x01
        weights.write_bytes(bytes(data))
        return real(path, *a, **kw)

    monkeypatch.setattr(mlx_lm, "load", load_during_an_update)
    _, _, cache = client.load(model_copy, home=kv_home, stats=False, overlap=overlap)
    try:
        assert cache.report.entries == 0 and len(cache) == 0
        assert "changed while it was loading" in cache.report.warning
    finally:
        cache.close()


def test_load_without_a_store_warns_and_loads(llama_path, tmp_path):
    model, _, cache = client.load(llama_path, home=tmp_path / "no-home", stats=False)
    try:
        assert cache.report.entries == 0 and "prefilling as usual" in cache.report.warning
        assert model(mx.array([[1, 2]])).shape[-1] == 512
    finally:
        cache.close()


def test_a_process_that_used_load_exits_cleanly(hybrid_path, kv_home, tmp_path):
    warm_two_pins(tmp_path, kv_home, hybrid_path)
    code = textwrap.dedent(f"""
        from kvstore import client
        for _ in range(3):
            model, tok, cache = client.load({str(hybrid_path)!r}, home={str(kv_home)!r},
                                            stats=False)
            assert cache.report.entries == 2, cache.report
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.parametrize("warm", [True, False])
def test_load_pays_the_first_calls_one_time_costs(
    warm, hybrid_path, kv_home, tmp_path, monkeypatch
):
    """The chat template is compiled and one forward runs on a copy of the largest hydrated
    prefix inside load (warm=True), so the app's first generate does not pay them; the cache's
    own entries are untouched by it."""
    from transformers.utils import chat_template_utils

    from kvstore.codec import codec

    metas = warm_two_pins(tmp_path, kv_home, hybrid_path)
    compiled = chat_template_utils._compile_jinja_template  # an lru_cache
    compiled.cache_clear()
    forwards = []
    real = LOAD_MODULE.first_call
    monkeypatch.setattr(
        LOAD_MODULE, "first_call", lambda m, t, e: forwards.append(e) or real(m, t, e)
    )
    model, _, cache = client.load(hybrid_path, home=kv_home, stats=False, warm=warm)
    try:
        assert (compiled.cache_info().currsize == 1) is warm
        if warm:
            longest = max(m.ntokens for m in metas.values())
            assert len(forwards) == 1 and codec.cache_tokens(forwards[0]) == longest
        for meta in metas.values():
            kv, rest = cache.fetch_nearest_cache(str(hybrid_path), meta.token_ids())
            assert rest == []
            assert_same_kv(kv, mlx_lm_prefill(model, meta.token_ids()))
    finally:
        cache.close()


def test_load_warms_on_a_fresh_cache_when_every_entry_is_large(
    hybrid_path, kv_home, tmp_path, monkeypatch
):
    """Above WARM_ENTRY_BYTES a stored prefix's grown copy would cost load as much as the
    request it spares: the warm-up forward then runs on a fresh cache."""
    warm_two_pins(tmp_path, kv_home, hybrid_path)
    monkeypatch.setattr(LOAD_MODULE, "WARM_ENTRY_BYTES", 0)
    forwards = []
    real = LOAD_MODULE.first_call
    monkeypatch.setattr(
        LOAD_MODULE, "first_call", lambda m, t, e: forwards.append(e) or real(m, t, e)
    )
    _, _, cache = client.load(hybrid_path, home=kv_home, stats=False)
    try:
        assert forwards == [None] and cache.report.entries == 2
    finally:
        cache.close()
