"""`kvstore export` files import back (their token ids travel in the file's metadata, the model
path resolved), and an import of KV the store already holds leaves that entry as it is."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import TWO_PINS, Proc, assert_same_kv, cli, manifest_for, mlx_lm_prefill, serving
from mlx_lm import load
from mlx_lm.models.cache import LRUPromptCache, load_prompt_cache

from kvstore.client import hydrate
from kvstore.codec import codec
from kvstore.identity.fingerprint import with_model_location
from kvstore.kvcheck.prefill import prefill
from kvstore.store.entry import entry_key, pack_tokens
from kvstore.store.store import Store


def ls_json(*args) -> list[dict]:
    return json.loads(cli("ls", "--json", *args, code=0).output)


def test_warm_export_evict_import_hydrates_a_fresh_prefill(warmed, llama_path, kv_home, tmp_path):
    (entry,) = ls_json("--label", "classify")
    out = tmp_path / "classify.safetensors"
    cli("export", entry["key"][32:44], out, code=0)
    _, metadata = load_prompt_cache(str(out), return_metadata=True)
    with Store(kv_home, readonly=True) as store:
        tokens = store.get_meta(bytes.fromhex(entry["key"])).token_ids()
    assert json.loads(metadata["token_ids"]) == tokens

    cli("evict", "--label", "classify", code=0)
    assert ls_json("--label", "classify") == []
    r = cli("import", out, "--model", llama_path, "--label", "classify", code=0)  # no --tokens
    assert f"imported {entry['key']} ({len(tokens)} tokens" in r.output, r.output

    model, _ = load(str(llama_path))
    lru = LRUPromptCache(max_size=10)
    report = hydrate(lru, "m", llama_path, home=kv_home, model=model)
    assert report.warning is None and report.entries == 2
    cache, rest = lru.fetch_nearest_cache("m", tokens)
    assert rest == []
    assert_same_kv(cache, mlx_lm_prefill(model, tokens, None))


def test_a_file_without_token_ids_asks_for_them_in_one_line(llama_path, kv_home, tmp_path):
    from mlx_lm.models.cache import save_prompt_cache

    model, _ = load(str(llama_path))
    file = tmp_path / "plain.safetensors"
    save_prompt_cache(str(file), prefill(model, [5, 6, 7]), {"model": str(llama_path)})
    r = cli("import", file, "--model", llama_path)
    assert r.exit_code == 2 or r.exit_code == 1, r.output
    assert "carries no token ids" in r.output and "--tokens" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output


def test_export_names_the_model_by_its_absolute_path(llama_path, kv_home, tmp_path, monkeypatch):
    """An entry stored with a relative model path (as an app or serve in the model's parent
    folder gives it) exports the absolute one: mlx_lm.generate loads it from any folder."""
    monkeypatch.chdir(llama_path.parent)
    rel = f"./{llama_path.name}"
    model, _ = load(rel)
    tokens = [3, 4, 5, 6, 7, 8]
    fp = bytes.fromhex(json.loads(cli("fingerprint", rel, "--json", code=0).output)["fingerprint"])
    key = entry_key(fp, tokens)
    with Store(kv_home) as store:  # recording where the model resolved, as the put operation does
        fields = with_model_location(dict(tokens=pack_tokens(tokens), label="app", model=rel))
        store.put(key, codec.encode(prefill(model, tokens), {"model": rel}), **fields)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cli("export", key.hex(), "out.safetensors", code=0)
    _, metadata = load_prompt_cache("out.safetensors", return_metadata=True)
    assert metadata["model"] == str(llama_path.resolve())
    # generate takes the model from the file's metadata, here, away from where the entry was made
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_lm", "generate", "--prompt-cache-file", "out.safetensors",
         "--prompt", "hi", "--max-tokens", "2"],
        capture_output=True, text=True, timeout=120, cwd=elsewhere,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_importing_a_stored_pin_keeps_its_label_owner_and_pin(
    warmed, llama_path, kv_home, tmp_path
):
    (before,) = ls_json("--label", "classify")
    out = tmp_path / "classify.safetensors"
    cli("export", before["key"], out, code=0)
    tokens = tmp_path / "tokens.json"  # given as mlx_lm.cache_prompt's users give them
    with Store(kv_home, readonly=True) as store:
        tokens.write_text(json.dumps(store.get_meta(bytes.fromhex(before["key"])).token_ids()))
    r = cli("import", out, "--model", llama_path, "--tokens", tokens, "--label", "classify2",
            code=0)  # fmt: skip
    assert f"already stored as pin 'classify' (manifest {warmed})" in r.output, r.output
    assert "imported" not in r.output.replace("nothing imported", "")
    (after,) = ls_json("--label", "classify")
    assert ls_json("--label", "classify2") == []
    assert (after["key"], after["pinned"], after["created"]) == (
        before["key"],
        True,
        before["created"],
    )
    with Store(kv_home, readonly=True) as store:
        meta = store.get_meta(bytes.fromhex(before["key"]))
    assert meta.source == "manifest" and meta.extra.owners == [f"manifest:{warmed}"]
    assert "present   classify" in cli("warm", "--manifest", warmed, code=0).output


def test_importing_a_stored_pin_through_the_daemon_keeps_it(llama_path, kv_home, tmp_path):
    manifest = manifest_for(tmp_path, llama_path, TWO_PINS)
    kv_home.mkdir(mode=0o700)
    with serving(Proc(kv_home, "--manifest", str(manifest), log=tmp_path / "daemon.log")) as d:
        (before,) = [e for e in d.request("ls") if e["label"] == "classify"]
        out = tmp_path / "classify.safetensors"
        cli("export", before["key"], out, code=0)
        r = cli("import", out, "--model", llama_path, "--label", "classify2", code=0)
        assert f"already stored as pin 'classify' (manifest {manifest})" in r.output, r.output
        labels = sorted(e["label"] for e in d.request("ls"))
    assert labels == ["classify", "synthesize"]


def test_an_import_replaces_a_damaged_pin_in_its_own_name(warmed, llama_path, kv_home, tmp_path):
    (before,) = ls_json("--label", "classify")
    key = bytes.fromhex(before["key"])
    out = tmp_path / "classify.safetensors"
    cli("export", before["key"], out, code=0)
    with Store(kv_home) as store:
        blob = bytearray(store.read_blob(key))
        blob[len(blob) // 2] ^= 0xFF
        with store.env.begin(write=True) as txn:
            txn.put(key, bytes(blob), db=store._blob)
    r = cli("import", out, "--model", llama_path, "--label", "classify2", code=0)
    assert f"imported {before['key']}" in r.output, r.output
    with Store(kv_home, readonly=True) as store:
        assert store.check() == []
        meta = store.get_meta(key)
    assert (meta.label, meta.pinned, meta.source) == ("classify", True, "manifest")
    assert meta.extra.owners == [f"manifest:{warmed}"]
