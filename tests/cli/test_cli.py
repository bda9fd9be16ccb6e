"""The CLI through click's CliRunner (and mlx-lm's own CLIs for export/import compatibility)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import TWO_PINS, assert_same_kv, cli, manifest_for
from mlx_lm.models.cache import load_prompt_cache

from kvstore.cli.main import main
from kvstore.store.entry import entry_key, pack_tokens
from kvstore.store.store import Store


def ls_json(home=None):
    args = ["ls", "--json"] + (["--home", home] if home else [])
    return json.loads(cli(*args, code=0).output)


def test_warm_then_ls(warmed, llama_path, kv_home):
    entries = ls_json()
    assert {e["label"] for e in entries} == {"classify", "synthesize"}
    for e in entries:
        for field in (
            "key",
            "model",
            "fingerprint",
            "label",
            "tokens",
            "nbytes",
            "pinned",
            "created",
            "last_used",
            "hits",
        ):
            assert field in e
        assert e["pinned"] is True and len(e["key"]) == 64 and e["key"].startswith(e["fingerprint"])
        assert e["model"] == str(llama_path)
    human = cli("ls", code=0).output
    assert "classify" in human and "You are the router" in human  # first tokens decoded
    # warming again is free: nothing re-prefilled, same created stamps
    out = cli("warm", "--manifest", warmed, code=0).output
    assert "0 warmed, 2 present" in out
    assert {e["created"] for e in ls_json()} == {e["created"] for e in entries}


def test_every_command_takes_home(warmed, kv_home, tmp_path):
    other = tmp_path / "other-home"
    assert ls_json(other) == []
    assert len(ls_json(kv_home)) == 2


def test_evict_filters(warmed, kv_home):
    entries = ls_json()
    cli("evict", "--label", "classify", code=0)
    assert [e["label"] for e in ls_json()] == ["synthesize"]
    key = ls_json()[0]["key"]
    result = cli("evict", "ffffff")
    assert result.exit_code != 0 and "matches no entry" in result.output
    cli("evict", key[:12], code=0)
    assert ls_json() == []
    assert len(entries) == 2


def test_evict_refuses_a_key_prefix_shorter_than_6_digits_unless_yes(warmed, kv_home):
    # issue 43 item 8: `kvstore evict 0` deleted whichever entry's key started with 0
    keys = [e["key"] for e in ls_json()]
    a, b = (k[32:] for k in keys)  # the digest halves `ls` shows
    # a prefix of `a` alone: not of `b`, nor of a whole key (it starts with the fingerprint)
    short = next(a[:n] for n in range(1, 6) if not any(k.startswith(a[:n]) for k in (b, *keys)))
    result = cli("evict", short)
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1
    assert f"key {short!r} is " in result.output and "at least 6" in result.output
    assert "--yes" in result.output and len(ls_json()) == 2  # nothing removed
    assert "evicted 1 entry," in cli("evict", short, "--yes", code=0).output
    assert [e["key"][32:] for e in ls_json()] == [b]


def test_evict_unpinned_to_size_and_all(warmed, kv_home):
    with Store(kv_home) as store:
        for i in range(3):
            store.put(
                entry_key(bytes([0xAB]) * 16, [i]),
                bytes(1000 * (i + 1)),
                tokens=pack_tokens([i]),
                label=f"u{i}",
            )
    assert len(ls_json()) == 5
    result = cli("evict")
    assert result.exit_code != 0 and "name what to evict" in result.output
    pinned_bytes = sum(e["nbytes"] for e in ls_json() if e["pinned"])
    cli("evict", "--to-size", str(pinned_bytes + 3000), code=0)
    left = {e["label"] for e in ls_json()}
    assert {"classify", "synthesize"} <= left and "u0" not in left  # LRU first, pins kept
    cli("evict", "--unpinned", code=0)
    assert {e["label"] for e in ls_json()} == {"classify", "synthesize"}
    cli("evict", "--all", code=0)
    assert ls_json() == []


def test_evict_stale_after_model_change(warmed, llama_path, kv_home, tmp_path):
    import shutil

    model = tmp_path / "model-copy"
    shutil.copytree(llama_path, model)
    config = model / "config.json"
    config.write_text(config.read_text().replace("1e-05", "3e-05"))  # another model now
    cli("warm", "--manifest", manifest_for(tmp_path, model, TWO_PINS, name="copy.toml"), code=0)
    assert len(ls_json()) == 4
    config.write_text(config.read_text().replace("3e-05", "2e-05"))
    cli("evict", "--stale", code=0)
    assert {e["model"] for e in ls_json()} == {str(llama_path)}


def test_stats_and_fingerprint(warmed, llama_path, kv_home):
    stats = json.loads(cli("stats", "--json", code=0).output)
    assert stats["entries"] == 2 and stats["pinned"] == 2 and stats["bytes"] > 0
    assert stats["settings"]["max_bytes"] > 0
    fields = dict(ln.split() for ln in cli("fingerprint", llama_path, code=0).output.splitlines())
    fp = fields["fingerprint"]
    assert all(e["fingerprint"] == fp for e in ls_json())


def test_user_errors_are_one_line(kv_home, tmp_path):
    result = cli("warm", "--manifest", tmp_path / "missing.toml")
    assert result.exit_code == 1 and "missing.toml" in result.output
    assert len(result.output.strip().splitlines()) == 1
    bad = manifest_for(
        tmp_path, "/nope", '[[model.prefix]]\nname = "x"\ntext = "hi"\n', name="bad.toml"
    )
    result = cli("warm", "--manifest", bad)
    assert result.exit_code == 1 and "/nope" in result.output
    result = cli("fingerprint", tmp_path / "nope")
    assert result.exit_code == 1 and "no such directory" in result.output


def test_export_loads_in_mlx_lm(warmed, llama_path, kv_home, tmp_path):
    entry = ls_json()[0]
    out = tmp_path / "pin.safetensors"
    cli("export", entry["key"][32:42], out, code=0)  # the short form `ls` shows
    cache, metadata = load_prompt_cache(str(out), return_metadata=True)
    assert metadata["model"] == str(llama_path) and "tokenizer_config" in metadata
    assert cache[0].offset == entry["tokens"]
    # mlx_lm.generate itself accepts the file
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_lm",
            "generate",
            "--model",
            str(llama_path),
            "--prompt-cache-file",
            str(out),
            "--prompt",
            "hello",
            "--max-tokens",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_import_from_mlx_lm_cache_prompt(llama_path, hybrid_path, kv_home, tmp_path):
    cache_file = tmp_path / "cp.safetensors"
    prompt = "You are a careful assistant. Classify the request."
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_lm",
            "cache_prompt",
            "--model",
            str(llama_path),
            "--prompt-cache-file",
            str(cache_file),
            "--prompt",
            prompt,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = cli("import", cache_file, "--model", hybrid_path, "--prompt", prompt)
    assert result.exit_code == 1 and "does not match model" in result.output
    result = cli("import", cache_file, "--model", llama_path, "--prompt", prompt + " more")
    assert result.exit_code == 1 and "tokens" in result.output
    cli(
        "import",
        cache_file,
        "--model",
        llama_path,
        "--prompt",
        prompt,
        "--label",
        "cp",
        "--pin",
        code=0,
    )
    (entry,) = ls_json()
    assert entry["label"] == "cp" and entry["pinned"] is True
    with Store(kv_home) as store:
        meta, cache = store.load(bytes.fromhex(entry["key"]))
    assert_same_kv(cache, load_prompt_cache(str(cache_file)))


def test_stats_shows_the_prefill_ledger(kv_home):
    from kvstore.home.ledger import Ledger, validate

    kv_home.mkdir(parents=True)
    rec = dict(
        model="/m/qwen",
        label="classify",
        prompt_tokens=1000,
        cached_tokens=900,
        prefilled_tokens=100,
        prefill_s=0.5,
        decode_s=1.0,
    )
    Ledger(kv_home).append(validate([rec, rec]))
    data = json.loads(cli("stats", "--json", code=0).output)
    (row,) = data["ledger"]["by_model_label"]
    assert row["calls"] == 2 and row["cached_tokens"] == 1800 and row["prefilled_tokens"] == 200
    assert row["saved_s"] == pytest.approx(1800 * 1.0 / 200)  # at the label's own prefill rate
    out = cli("stats", code=0).output
    assert "classify" in out and "SAVED" in out and "9.00" in out


def _commands(group, ctx, path=()):
    import click

    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, click.Context(cmd, parent=ctx), (*path, name))
        else:
            yield (*path, name)


def test_every_command_lists_home_in_its_help():
    import click

    commands = list(_commands(main, click.Context(main)))
    for expected in (("analyze",), ("service", "status"), ("service", "uninstall"), ("verify",)):
        assert expected in commands
    missing = [" ".join(c) for c in commands if "--home" not in cli(*c, "--help", code=0).output]
    assert not missing, f"commands without --home: {missing}"


def test_counts_of_one_are_in_the_singular(warmed):
    assert "evicted 1 entry," in cli("evict", "--label", "classify", code=0).output
    assert "\n1 entry, " in "\n" + cli("ls", code=0).output
    assert "1 entry ok" in cli("verify", code=0).output
    assert "evicted 1 entry," in cli("evict", "--all", code=0).output
    assert "0 entries, " in cli("ls", code=0).output
