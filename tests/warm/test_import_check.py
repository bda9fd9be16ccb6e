"""`kvstore import` stores a prompt-cache file only when its KV is what this model computes for
these tokens: re-prefilled and compared within the upgrade canary's tolerance. Before, only the
token count, the shapes and the file's model name were checked, so another model's KV (same
architecture) or other tokens of the same count were stored and served.
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from helpers import assert_same_kv, cli, import_here
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache

from kvstore.kvcheck.prefill import prefill
from kvstore.store.store import Store
from kvstore.tiny import make_tiny_model
from kvstore.warm import importfit
from kvstore.warm.importfit import ImportMismatch
from kvstore.warm.transfer import _prompt_tokens

PROMPT = (
    "You are a test assistant. This prompt is cached by mlx_lm cache_prompt for import testing."
)
OTHER = PROMPT.replace("test", "best")  # the same number of tokens, other ones


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny llamas of the same shape: A (seed 0) and B (seed 1)."""
    root = tmp_path_factory.mktemp("ab")
    return make_tiny_model(root / "A", seed=0), make_tiny_model(root / "B", seed=1)


def cache_prompt(model_path, tokens, file, metadata=None):
    """What `mlx_lm.cache_prompt` writes: the prompt through generate_step, then saved."""
    model, _ = load(str(model_path))
    cache = make_prompt_cache(model)
    for _ in generate_step(mx.array(tokens), model, max_tokens=0, prompt_cache=cache):
        pass
    save_prompt_cache(str(file), cache, metadata or {})
    return file


@pytest.fixture(scope="module")
def b_file(models, tmp_path_factory):
    """B's cache of PROMPT, as mlx_lm.cache_prompt --model B writes it (model name included)."""
    _, b = models
    file = tmp_path_factory.mktemp("files") / "B.safetensors"
    return cache_prompt(b, _prompt_tokens(b, PROMPT), file, {"model": str(b)})


@pytest.fixture(scope="module")
def b0_file(models, b_file):
    """The same cache saved again without metadata (no model name to compare)."""
    _, b = models
    return cache_prompt(b, _prompt_tokens(b, PROMPT), b_file.with_name("B0.safetensors"))


def test_another_models_kv_is_refused(models, b0_file, kv_home):
    a, _ = models
    with Store(kv_home) as store:
        with pytest.raises(ImportMismatch, match=r"layer \d+ \(KVCache\), from position 0: .*"
                           r"over tolerance .*max abs diff"):  # fmt: skip
            import_here(store, b0_file, model=str(a), prompt=PROMPT, home=kv_home)
        assert store.metas() == []


def test_other_tokens_of_the_same_count_are_refused(models, b_file, kv_home):
    _, b = models
    mine, other = _prompt_tokens(b, PROMPT), _prompt_tokens(b, OTHER)
    assert len(mine) == len(other) and mine != other
    first = next(i for i, (x, y) in enumerate(zip(mine, other)) if x != y)
    with Store(kv_home) as store:
        with pytest.raises(ImportMismatch, match=rf"from position {first}: "):
            import_here(store, b_file, model=str(b), prompt=OTHER, home=kv_home)
        assert store.metas() == []


def test_the_right_file_is_stored_and_hydrates_as_a_fresh_prefill(models, b_file, kv_home):
    _, b = models
    tokens = _prompt_tokens(b, PROMPT)
    with Store(kv_home) as store:
        meta = import_here(store, b_file, model=str(b), prompt=PROMPT, home=kv_home)
        _, stored = store.load(meta.key, meta.tokens)
    assert meta.extra.checked is True and not meta.extra.trusted
    assert meta.extra.check == f"all {len(tokens)} positions"
    model, _ = load(str(b))
    assert_same_kv(stored, prefill(model, tokens))


def test_a_long_cache_is_checked_on_windows_to_its_end(models, kv_home, tmp_path, monkeypatch):
    """Past FULL_CHECK_TOKENS a plain KV cache is compared on a re-prefilled prefix and on
    windows spread to its end: a token changed at the very end is still caught."""
    monkeypatch.setattr(importfit, "FULL_CHECK_TOKENS", 16)
    monkeypatch.setattr(importfit, "SAMPLE_WINDOW", 8)
    _, b = models
    tokens = list(range(3, 3 + 120))
    file = cache_prompt(b, tokens, tmp_path / "long.safetensors")
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps(tokens[:-1] + [tokens[-1] + 1]))
    with Store(kv_home) as store:
        with pytest.raises(ImportMismatch, match="from position 119: "):
            import_here(store, file, model=str(b), tokens_file=wrong, home=kv_home)
        assert store.metas() == []
        right = tmp_path / "right.json"
        right.write_text(json.dumps(tokens))
        meta = import_here(store, file, model=str(b), tokens_file=right, home=kv_home)
    assert meta.extra.check.startswith("80 of 120 positions (the first 16 and 8 windows)")


def test_token_ids_outside_the_vocabulary_are_a_one_line_error(models, b0_file, kv_home, tmp_path):
    _, b = models
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([1] * 48 + [99999]))
    result = cli("import", b0_file, "--model", b, "--tokens", ids)
    assert result.exit_code == 1
    assert f"{ids}: token id 99999 (position 48) is out of range" in result.output
    assert "the vocabulary has 512 ids" in result.output and "Traceback" not in result.output


def test_trust_stores_it_unchecked_shown_by_ls_and_verify(models, b0_file, kv_home):
    a, _ = models
    out = cli(
        "import", b0_file, "--model", a, "--prompt", PROMPT, "--trust", "--label", "t", code=0
    ).output
    assert "trusted: not checked" in out
    (entry,) = json.loads(cli("ls", "--json", code=0).output)
    assert entry["trusted"] is True and entry["checked"] is False
    assert "trusted, unchecked" in cli("ls", code=0).output
    out = cli("verify", code=0).output
    assert "1 entries ok" in out or "1 entry ok" in out
    assert f"unchecked {entry['key']} 't'" in out and "imported with --trust" in out


def test_verify_deep_re_prefills_entries_that_are_not_manifest_pins(
    models, b_file, b0_file, kv_home
):
    """Imports (and app pins) are no manifest's pins; --deep compares each with a re-prefill.
    Without --manifest and with no manifest at all it checks them rather than failing."""
    a, b = models
    cli("import", b0_file, "--model", a, "--prompt", PROMPT, "--trust", "--label", "wrong", code=0)
    cli("import", b_file, "--model", b, "--prompt", PROMPT, "--label", "right", code=0)
    out = cli("verify", "--deep", code=1).output
    assert "DIFFERS" in out and "'wrong'" in out and "from position 0" in out
    assert "ok" in out and "'right'" in out
    assert "1 entry computed other KV than stored" in out
    out = cli("verify", "--deep", "--repair", code=1).output
    assert "deleted" in out
    assert [e["label"] for e in json.loads(cli("ls", "--json", code=0).output)] == ["right"]
    out = cli("verify", "--deep", code=0).output
    assert "'right'" in out
