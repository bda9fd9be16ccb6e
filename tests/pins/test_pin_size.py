"""A pin whose content is too big for max_pin_tokens by its size alone is refused before it is
tokenized (issue 34 item 5: a 400,010-token prompt file took 28 s and 602 MB to be refused): one
line naming the file, its size and the limit."""

from __future__ import annotations

import pytest
from helpers import cli

import kvstore.pins.render
from kvstore.pins.manifest import MAX_BYTES_PER_TOKEN, PrefixSpec, load_manifest, oversized
from kvstore.store.store import Store


@pytest.fixture
def big_file_manifest(llama_path, tmp_path):
    (tmp_path / "big.txt").write_text("The quick brown fox jumps over the lazy dog. " * 1000)
    manifest = tmp_path / "pins.toml"
    manifest.write_text(f"""
[[model]]
path = "{llama_path}"

[[model.prefix]]
name = "big"
file = "big.txt"

[[model.prefix]]
name = "short"
text = "You are the writer."
""")
    return manifest


def test_a_prompt_file_too_big_for_max_pin_tokens_is_refused_untokenized(
    big_file_manifest, kv_home, tmp_path, monkeypatch
):
    rendered = []
    real = kvstore.pins.render._render_chat
    monkeypatch.setattr(kvstore.pins.render, "_render_chat",
                        lambda t, p, now: rendered.append(p.name) or real(t, p, now))  # fmt: skip
    kv_home.mkdir(mode=0o700)
    (kv_home / "settings.toml").write_text("max_pin_tokens = 1000\n")
    r = cli("warm", "--manifest", big_file_manifest)
    assert r.exit_code == 1, r.output
    big = tmp_path / "big.txt"
    want = (
        f"pin 'big': {big} is 45,000 bytes, over the {1000 * MAX_BYTES_PER_TOKEN:,} bytes that "
        f"max_pin_tokens=1,000 tokens can hold (at most {MAX_BYTES_PER_TOKEN} bytes a token); "
        "not tokenized: shorten it or raise max_pin_tokens in settings.toml"
    )
    lines = [ln for ln in r.output.splitlines() if "'big'" in ln]
    assert len(lines) == 1 and want in lines[0], r.output
    assert "Traceback" not in r.output
    assert rendered == []  # never tokenized
    with Store(kv_home, readonly=True) as store:
        assert [m.label for m in store.metas()] == ["short"]  # the other pin warms


def test_content_that_may_fit_is_left_to_the_tokenizer(big_file_manifest):
    (spec,) = load_manifest(big_file_manifest).models
    big, short = spec.prefixes
    assert oversized(big, 45_000 // MAX_BYTES_PER_TOKEN + 1) is None  # its tokens decide
    assert oversized(big, 45_000 // MAX_BYTES_PER_TOKEN - 1) is not None
    assert oversized(short, 1) is not None and "its text is 19 bytes" in oversized(short, 1)
    assert oversized(short, 2) is None
    chat = PrefixSpec("chat", ({"role": "system", "content": "é" * 20},), None, None, None, None)
    assert "pin 'chat': its messages are 40 bytes, over the 32 bytes" in oversized(chat, 2)
