"""Token ids outside the model's vocabulary are a ValueError naming the id and the vocabulary
size on every path that takes ids, never a crash: mlx indexes the embedding unchecked, so such an
id used to kill the process with SIGSEGV. The app paths run in a child process, so a crash is a
failed test rather than a dead pytest."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import mlx.core as mx
import numpy as np
import pytest
from helpers import cli, manifest_for
from mlx_lm import load
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache, save_prompt_cache

from kvstore.client import PersistentPromptCache, generate
from kvstore.client.hydrate import hydrate
from kvstore.codec import codec
from kvstore.home.settings import FILEHASH_NAME
from kvstore.identity.fingerprint import FileHashCache, model_fingerprint
from kvstore.kvcheck.prefill import check_token_ids
from kvstore.ops.warm import warm
from kvstore.pins.manifest import load_manifest
from kvstore.store.entry import entry_key, pack_tokens
from kvstore.store.store import Store

VOCAB = 512  # the tiny models' embedding rows

PATHS = {
    "pin": "PersistentPromptCache.open(model, tok, path, stats=False).pin('bad', tokens=IDS)",
    "prefill": "prefill(model, IDS)",
    "generate": "generate(PersistentPromptCache.open(model, tok, path, stats=False), model, tok,"
    " IDS, max_tokens=1)",
}


def run_child(model_path, home, call: str, ids: list[int]) -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        import mlx_lm
        from kvstore.client import PersistentPromptCache, generate
        from kvstore.kvcheck.prefill import prefill
        path, IDS = {str(model_path)!r}, {ids!r}
        model, tok = mlx_lm.load(path)
        try:
            {call}
        except ValueError as e:
            print("ValueError:", e)
        else:
            print("accepted")
    """)
    env = {**os.environ, "KVSTORE_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )


@pytest.mark.parametrize("bad", [VOCAB, 99999, -1])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_out_of_vocabulary_ids_raise_valueerror_not_a_crash(path, bad, llama_path, kv_home):
    done = run_child(llama_path, kv_home, PATHS[path], [1, 2, bad])
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stderr[-2000:]}"
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("ValueError:"), line
    assert f"token id {bad}" in line and f"{VOCAB} ids" in line


def test_ids_in_the_vocabulary_still_pin(llama_path, kv_home):
    done = run_child(llama_path, kv_home, PATHS["pin"], [1, 2, VOCAB - 1])
    assert done.returncode == 0 and done.stdout.strip().endswith("accepted"), done.stderr


def test_check_token_ids_names_the_id_and_the_vocabulary():
    assert check_token_ids([0, 5, 511], VOCAB) == (0, 5, 511)
    with pytest.raises(ValueError, match=r"pin 'x': token id 512 \(position 1\).*512 ids"):
        check_token_ids([3, 512], VOCAB, what="pin 'x'")
    with pytest.raises(ValueError, match="not an integer"):
        check_token_ids([1.5], VOCAB)


def test_import_refuses_token_ids_outside_the_vocabulary(llama_path, kv_home, tmp_path):
    model, _ = load(str(llama_path))
    cache = make_prompt_cache(model)
    model(mx.array([1, 2, 3])[None], cache=cache)
    mx.eval([c.state for c in cache])
    file = tmp_path / "cache.safetensors"
    save_prompt_cache(str(file), cache, {"model": str(llama_path), "tokenizer_config": "{}"})
    (tmp_path / "tokens.json").write_text(json.dumps([1, 2, 99999]))
    args = [
        "import",
        str(file),
        "--model",
        str(llama_path),
        "--tokens",
        str(tmp_path / "tokens.json"),
    ]
    result = cli(*args, "--home", kv_home)
    assert result.exit_code == 1, result.output
    assert "token id 99999" in result.output and "512 ids" in result.output
    assert "Traceback" not in result.output
    with Store(kv_home, readonly=True) as store:
        assert store.metas() == []


def test_hydrate_skips_stored_entries_keyed_by_ids_outside_the_vocabulary(llama_path, kv_home):
    model, _ = load(str(llama_path))
    cache = make_prompt_cache(model)
    model(mx.array([1, 2, 3])[None], cache=cache)
    mx.eval([c.state for c in cache])
    fp = model_fingerprint(llama_path, hash_cache=FileHashCache(kv_home / FILEHASH_NAME))
    bad = [1, 2, 99999]  # a damaged or foreign entry: no prefill of this model made it
    with Store(kv_home) as store:
        store.put(
            entry_key(fp.digest, bad),
            codec.encode(cache, {"model": str(llama_path), "tokenizer_config": "{}"}),
            tokens=pack_tokens(bad),
            label="bad",
            pinned=True,
            model=str(llama_path),
            template_hash=b"\0" * 16,
            classes=codec.cache_classes(cache),
        )
    lru = LRUPromptCache()
    report = hydrate(lru, "m", llama_path, home=kv_home, model=model)
    assert report.entries == 0 and len(lru) == 0
    assert "token id 99999" in report.skipped[0] and "512 ids" in report.skipped[0]


def test_warm_fails_a_pin_whose_text_tokenizes_past_the_vocabulary(llama_path, kv_home, tmp_path):
    """A tokenizer that knows more ids than the model embeds (a mismatched download): the pin
    fails with the id and the size named, the daemon's warm goes on, nothing is stored."""
    small = tmp_path / "small-vocab"
    shutil.copytree(llama_path, small)
    weights = mx.load(str(small / "model.safetensors"))
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"][:8]
    mx.save_safetensors(str(small / "model.safetensors"), weights, {"format": "mlx"})
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": 8}))
    prefix = '[[model.prefix]]\nname = "raw"\ntext = "You are a careful assistant."\n'
    with Store(kv_home) as store:
        report = warm(load_manifest(manifest_for(tmp_path, small, prefix)), store, home=kv_home)
        assert store.metas() == []
    (pin,) = report.pins
    assert pin.status == "failed"
    assert "token id" in pin.error and "the vocabulary has 8 ids" in pin.error


HELD = {  # token ids as apps hold them
    "list": [1, 2, 3],
    "tuple": (1, 2, 3),
    "range": range(1, 4),
    "numpy ints": [np.int64(1), np.int32(2), np.uint16(3)],
    "numpy array": np.array([1, 2, 3]),
    "numpy uint32 array": np.array([1, 2, 3], dtype=np.uint32),
    "mx.array": mx.array([1, 2, 3]),
    "mx.array uint32": mx.array([1, 2, 3], dtype=mx.uint32),
}
REFUSED = {  # (ids, what the one line says)
    "bools": ([True, False], "token 0 is True, not an integer token id"),
    "a bool among ids": ([1, False], "token 1 is False, not an integer token id"),
    "numpy bools": (np.array([True, False]), "token 0 is True, not an integer"),
    "mx bools": (mx.array([True, False]), "token 0 is True, not an integer"),
    "floats": (np.array([1.0, 2.0]), "token 0 is 1.0, not an integer"),
    "a batch": (mx.array([[1, 2, 3]]), r"token ids must be one row, got .* shape \(1, 3\)"),
}


def test_pin_and_generate_take_token_ids_as_apps_hold_them(llama_path):
    """`pin(tokens=)` and a prompt of ids take any sequence of ints, a numpy integer array and
    an mx.array: the same pin, the same prompt."""
    model, tok = load(str(llama_path))
    with PersistentPromptCache.open(model, tok, llama_path, verbose=False) as cache:
        for held, ids in HELD.items():
            pin = cache.pin(f"p-{held.replace(' ', '-').replace('.', '-')}", tokens=ids)
            assert pin.tokens == (1, 2, 3) and type(pin.tokens[0]) is int, held
        texts = {held: generate(cache, model, tok, ids, max_tokens=2) for held, ids in HELD.items()}
        assert len(set(texts.values())) == 1, texts
        assert [c.prompt_tokens for c in cache.stats.calls] == [3] * len(HELD)


@pytest.mark.parametrize("held", sorted(REFUSED))
def test_pin_and_generate_refuse_ids_that_are_not_token_ids_in_one_line(held, llama_path):
    """Bools are not token ids (`[True, False]` was pinned as ids 1, 0), nor floats, nor a
    batch of rows: one line naming what was wrong, nothing pinned, no call recorded."""
    ids, said = REFUSED[held]
    model, tok = load(str(llama_path))
    with PersistentPromptCache.open(model, tok, llama_path, verbose=False) as cache:
        with pytest.raises(ValueError, match=f"^pin 'p': {said}") as e:
            cache.pin("p", tokens=ids)
        assert "\n" not in str(e.value)
        with pytest.raises(ValueError, match=f"^prompt: {said}"):
            generate(cache, model, tok, ids, max_tokens=1)
        assert cache.pins == {} and cache.stats.calls == []
