"""Issue 10 item 2: the mlx-lm code that computes the KV is in the fingerprint, by content.

An edit of llama.py or of what it imports (rope_utils.py, base.py, cache.py) moves llama's
fingerprint; an edit of another architecture, a version string, or a `*.py` file in the model
directory (mlx-lm never runs one) does not.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore.identity import codehash
from kvstore.identity.fingerprint import model_fingerprint
from kvstore.identity.model import ModelIdentity


@pytest.fixture
def edited_module(tmp_path, monkeypatch):
    """edit(name): the fingerprint sees module `name` with one more line; the per-process cache
    is cleared around the test."""
    real = codehash._module_file
    edited: dict[str, Path] = {}

    def module_file(name):
        return edited.get(name) or real(name)

    def edit(name: str) -> None:
        src = real(name)
        copy = tmp_path / f"{name}.py"
        copy.write_bytes(src.read_bytes() + b"\n# an edit in a new mlx-lm release\n")
        edited[name] = copy
        codehash.module_closure_digest.cache_clear()

    monkeypatch.setattr(codehash, "_module_file", module_file)
    codehash.module_closure_digest.cache_clear()
    yield edit
    codehash.module_closure_digest.cache_clear()


def fp(path, *, model_object=None, **identity):
    """The fingerprint of `path` run as `identity` (ModelIdentity's fields) says."""
    return model_fingerprint(ModelIdentity(str(path), **identity), model_object=model_object).digest


def test_the_closure_is_read_from_the_imports(llama_path):
    name = codehash.arch_module_name({"model_type": "llama"})
    _, modules = codehash.module_closure_digest((name, codehash.CACHE_MODULE), ("mlx_lm.models",))
    assert name == "mlx_lm.models.llama"
    assert {"mlx_lm.models.rope_utils", "mlx_lm.models.base", "mlx_lm.models.cache"} <= set(modules)
    assert "mlx_lm.models.gemma3_text" not in modules
    # remapped as mlx_lm.utils._get_classes remaps it
    assert codehash.arch_module_name({"model_type": "mistral"}) == "mlx_lm.models.llama"
    # the hybrid's module pulls its attention from another architecture's module
    _, hybrid = codehash.module_closure_digest(
        (codehash.arch_module_name({"model_type": "qwen3_5"}),), ("mlx_lm.models",)
    )
    assert "mlx_lm.models.qwen3_next" in hybrid and "mlx_lm.models.gated_delta" in hybrid


@pytest.mark.parametrize(
    "module", ["mlx_lm.models.llama", "mlx_lm.models.rope_utils", "mlx_lm.models.cache"]
)
def test_an_edit_of_the_code_that_computes_the_kv_moves_the_fingerprint(
    llama_path, edited_module, module
):
    before = fp(llama_path)
    edited_module(module)
    assert fp(llama_path) != before


def test_unrelated_code_versions_and_model_py_files_do_not(model_copy, edited_module, monkeypatch):
    import mlx_lm

    before = fp(model_copy)
    edited_module("mlx_lm.models.gemma3_text")
    monkeypatch.setattr(mlx_lm, "__version__", "99.0.0")  # a release that left llama alone
    (model_copy / "modeling_llama.py").write_text("raise SystemExit('never run by mlx-lm')\n")
    assert fp(model_copy) == before


def test_kv_quantization_code_counts_only_when_quantizing(llama_path, monkeypatch):
    plain, quant = fp(llama_path), fp(llama_path, kv_bits=8)
    monkeypatch.setattr(codehash, "_quantize_source", lambda: b"def maybe_quantize(): changed")
    assert fp(llama_path) == plain
    assert fp(llama_path, kv_bits=8) != quant


def test_a_custom_model_file_is_hashed_as_code(model_copy, llama_path):
    from mlx_lm import load

    model, _ = load(str(llama_path))
    config = json.loads((model_copy / "config.json").read_text())
    config["model_file"] = "my_llama.py"
    (model_copy / "config.json").write_text(json.dumps(config))
    custom = model_copy / "my_llama.py"
    custom.write_text("from mlx_lm.models.llama import Model, ModelArgs\n")
    first = fp(model_copy, model_object=model)
    custom.write_text("from mlx_lm.models.llama import Model, ModelArgs  # edited\n")
    assert fp(model_copy, model_object=model) != first


def test_the_code_hash_is_cached_per_process(llama_path):
    codehash.module_closure_digest.cache_clear()
    fp(llama_path)
    fp(llama_path)
    info = codehash.module_closure_digest.cache_info()
    assert info.misses == 1 and info.hits >= 1


def test_entries_carry_the_mlx_versions_as_provenance(llama_path, kv_home, tmp_path):
    import mlx.core as mx
    import mlx_lm
    from helpers import TWO_PINS, manifest_for

    from kvstore.ops.warm import warm
    from kvstore.pins.manifest import load_manifest
    from kvstore.store.store import Store

    with Store(kv_home) as store:
        warm(load_manifest(manifest_for(tmp_path, llama_path, TWO_PINS)), store, home=kv_home)
        runtimes = {json.dumps(m.extra.runtime, sort_keys=True) for m in store.metas()}
    assert runtimes == {json.dumps({"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__})}
