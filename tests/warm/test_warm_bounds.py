"""Long pins are bounded and visible: `kvstore warm` says each pin's token count before its
prefill and, on a terminal, a slow prefill's progress; a pin longer than max_pin_tokens or the
model's context is refused before any prefill, one whose prefill does not fit the memory available
before its prefill, in one line each, while the other pins warm."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys

import pytest
from helpers import CLASSIFY, cli, manifest_for

import kvstore.kvcheck.prefill as prefill_mod
from kvstore.ops.warm import warm
from kvstore.pins.manifest import load_manifest
from kvstore.store.store import Store
from kvstore.warm import memory

PINS = f"""
[[model.prefix]]
name = "classify"
messages = [{{ role = "system", content = "{CLASSIFY}" }}]

[[model.prefix]]
name = "short"
text = "You are the writer."
"""

# `kvstore warm` with a slow clock: every reading of the progress clock is 3 s after the last,
# and 16 tokens per forward pass, so the 148-token pin runs 10 chunks "30 s" (deterministic).
SLOW = """
import sys
import kvstore.kvcheck.prefill, kvstore.warm.warm
kvstore.kvcheck.prefill.PREFILL_STEP = 16
t = [0.0]
def clock():
    t[0] += 3.0
    return t[0]
kvstore.warm.warm.progress_clock = clock
from kvstore.cli.main import main
main(["warm", *sys.argv[1:]])
"""


@pytest.fixture
def prefills(monkeypatch) -> list[int]:
    """The token count of every prefill that runs (kvstore.kvcheck.prefill.prefill, patched)."""
    ran: list[int] = []
    real = prefill_mod.prefill

    def counted(model, tokens, **kw):
        ran.append(len(tokens))
        return real(model, tokens, **kw)

    monkeypatch.setattr(prefill_mod, "prefill", counted)
    return ran


def on_a_terminal(args: list[str], code: str, timeout: float = 120) -> tuple[int, str]:
    """Run `python -c code ARGS` with stdout and stderr on a pseudo-terminal; (rc, output)."""
    master, slave = pty.openpty()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-c", code, *args]
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    rc = p.wait(timeout=timeout)
    return rc, b"".join(chunks).decode().replace("\r\n", "\n")


def test_a_slow_prefill_says_its_tokens_then_its_progress_on_a_terminal(
    llama_path, kv_home, tmp_path
):
    manifest = manifest_for(tmp_path, llama_path, PINS)
    rc, out = on_a_terminal(["--manifest", str(manifest), "--home", str(kv_home)], SLOW)
    assert rc == 0, out
    lines = out.splitlines()
    said = [i for i, x in enumerate(lines) if x.endswith(":: classify: prefilling 148 tokens")]
    progress = [i for i, x in enumerate(lines) if x.startswith("pin classify: ")]
    done = [i for i, x in enumerate(lines) if x.startswith("prefilled classify")]
    assert len(said) == 1 and len(done) == 1, out
    assert said[0] < progress[0] and progress[-1] < done[0], out
    # 16 tokens a chunk, a line per chunk (3 s apart, the terminal's 2 s interval), not the last
    assert len(progress) == 9, out
    assert lines[progress[0]] == "pin classify: 16 of 148 tokens (11%), 5 tokens/s"  # 16 in 3 s
    assert "pin short: " not in out  # 9 tokens: one chunk, nothing to report


def test_a_quick_prefill_says_its_tokens_and_no_progress(
    llama_path, kv_home, tmp_path, monkeypatch
):
    monkeypatch.setattr("kvstore.cli.options.tty", lambda: True)  # progress() prints
    out = cli("warm", "--manifest", manifest_for(tmp_path, llama_path, PINS), code=0).output
    assert ":: classify: prefilling 148 tokens" in out and ":: short: prefilling" in out, out
    assert "tokens/s" not in out, out


def test_a_pin_over_max_pin_tokens_is_refused_before_any_prefill(
    llama_path, kv_home, tmp_path, prefills
):
    kv_home.mkdir(mode=0o700)
    (kv_home / "settings.toml").write_text("max_pin_tokens = 100\n")
    r = cli("warm", "--manifest", manifest_for(tmp_path, llama_path, PINS))
    assert r.exit_code == 1, r.output
    want = (
        f"model {str(llama_path)!r}: pin 'classify' is 148 tokens, over max_pin_tokens "
        "(settings.toml) of 100 tokens; not prefilled"
    )
    assert want in r.output and "Traceback" not in r.output, r.output
    assert prefills == [9]  # only the short pin's
    with Store(kv_home, readonly=True) as store:
        assert [m.label for m in store.metas()] == ["short"]


def test_only_over_long_pins_load_no_model(llama_path, kv_home, tmp_path, prefills):
    manifest = load_manifest(manifest_for(tmp_path, llama_path, PINS))
    kv_home.mkdir(mode=0o700)
    (kv_home / "settings.toml").write_text("max_pin_tokens = 4\n")
    with Store(kv_home) as store:
        report = warm(manifest, store, home=kv_home)
    assert [p.status for p in report.pins] == ["failed", "failed"]
    assert report.models_loaded == 0 and prefills == []
    assert (
        "pin 'short' is 9 tokens, over max_pin_tokens (settings.toml) of 4" in report.pins[1].error
    )


@pytest.mark.parametrize("where", ["config", "tokenizer"])
def test_a_pin_over_the_model_context_is_refused(where, model_copy, kv_home, tmp_path, prefills):
    name, key = {
        "config": ("config.json", "max_position_embeddings"),
        "tokenizer": ("tokenizer_config.json", "model_max_length"),
    }[where]
    path = model_copy / name
    path.write_text(json.dumps({**json.loads(path.read_text()), key: 64}))
    r = cli("warm", "--manifest", manifest_for(tmp_path, model_copy, PINS))
    assert r.exit_code == 1, r.output
    assert "pin 'classify' is 148 tokens, over the " in r.output, r.output
    assert f"{key} in {name}) of 64 tokens" in r.output or f"{key} ({name}) of 64" in r.output
    assert prefills == [9]


def test_a_prefill_short_of_memory_is_refused_before_it_runs(
    llama_path, kv_home, tmp_path, prefills, monkeypatch
):
    fake = tmp_path / "available"
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: int(fake.read_text()))
    # the tiny model's 148-token pin needs ~0.4 MiB (KV 148 KiB, scratch 4 heads x 148^2 x 4 B)
    fake.write_text(str(300 * 1024))
    r = cli("warm", "--manifest", manifest_for(tmp_path, llama_path, PINS))
    assert r.exit_code == 1, r.output
    assert (
        "pin 'classify' (148 tokens) needs about 0.5 MiB to prefill (0.1 MiB of KV and 0.3 MiB"
        " of attention scratch for a 148-token chunk), 0.3 MiB is available" in r.output
    ), r.output
    assert "MiB is available; not prefilled: free memory or shorten the pin" in r.output
    assert prefills == [9]  # the short pin fits
    fake.write_text(str(2**30))
    r = cli("warm", "--manifest", manifest_for(tmp_path, llama_path, PINS), code=0)
    assert prefills == [9, 148]


def test_a_bad_max_pin_tokens_is_one_line(llama_path, kv_home, tmp_path):
    kv_home.mkdir(mode=0o700)
    (kv_home / "settings.toml").write_text('max_pin_tokens = "lots"\n')
    r = cli("warm", "--manifest", manifest_for(tmp_path, llama_path, PINS))
    assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1, r.output
    assert "max_pin_tokens must be a positive integer, got 'lots'" in r.output


def test_the_default_bounds_pins_at_32768_tokens():
    from kvstore.home.settings import DEFAULTS

    assert DEFAULTS["max_pin_tokens"] == 32768
