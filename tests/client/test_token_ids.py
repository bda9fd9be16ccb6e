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
import pytest
from helpers import cli, manifest_for
from mlx_lm import load
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache, save_prompt_cache

from kvstore.client.hydrate import hydrate
from kvstore.codec import codec
from kvstore.home.settings import FILEHASH_NAME
from kvstore.identity.fingerprint import FileHashCache, model_fingerprint
from kvstore.ops.warm import warm
from kvstore.pins.manifest import load_manifest
from kvstore.store.entry import entry_key, pack_tokens
from kvstore.store.store import Store
from kvstore.warm.prefill import check_token_ids

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
        from kvstore.warm.prefill import prefill
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
