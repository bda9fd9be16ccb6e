"""Pin names are one line of printable text (manifest, pin(), import --label), and a byte-order
mark at the start of a prompt file (or of the manifest) is dropped, as editors drop it."""

from __future__ import annotations

import pytest
from helpers import cli, manifest_for

from kvstore.errors import ManifestError
from kvstore.pins.manifest import load_manifest

# TOML escapes: the names hold a newline, a tab, a bell, NUL, a right-to-left override
BAD_NAMES = ["two\\nlines", "tab\\there", "bell\\u0007", "nul\\u0000", "rtl\\u202eevil"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_pin_name_with_a_control_character_is_refused_in_one_line(tmp_path, llama_path, name):
    path = manifest_for(tmp_path, llama_path, f'[[model.prefix]]\nname = "{name}"\ntext = "hi"\n')
    with pytest.raises(ManifestError) as e:
        load_manifest(path)
    msg = str(e.value)
    assert "\n" not in msg and "\t" not in msg, msg  # the message itself stays one line
    assert str(path) in msg and "field 'name'" in msg and "control character" in msg, msg
    result = cli("warm", "--manifest", path)
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, result.output
    assert "control character" in result.output
    assert not (tmp_path / "home").exists() or "0 entries" in cli("ls", code=0).output


def test_import_refuses_a_control_character_label(tmp_path, llama_path):
    cache = tmp_path / "c.safetensors"
    cache.write_bytes(b"x")
    result = cli("import", cache, "--model", llama_path, "--prompt", "hi", "--label", "a\nb")
    assert result.exit_code == 2, result.output
    assert "--label" in result.output and "control character" in result.output


def test_pin_refuses_a_control_character_name(llama_path, kv_home):
    from mlx_lm import load

    from kvstore.client import PersistentPromptCache

    model, tokenizer = load(str(llama_path))
    with PersistentPromptCache.open(model, tokenizer, llama_path, stats=False) as cache:
        for name in ("two\nlines", "", "tab\there"):
            with pytest.raises(ValueError, match="pin name"):
                cache.pin(name, tokens=[5, 6, 7])
        assert cache.pin("fine", tokens=[5, 6, 7]).tokens == (5, 6, 7)


def test_a_byte_order_mark_is_dropped_from_a_prompt_file(tmp_path, llama_path, kv_home):
    (tmp_path / "prompt.md").write_bytes("\ufeffYou are the router.".encode())
    path = manifest_for(tmp_path, llama_path, '[[model.prefix]]\nname = "a"\nfile = "prompt.md"\n')
    (spec,) = load_manifest(path).models
    assert spec.prefixes[0].messages[0]["content"] == "You are the router."
    (tmp_path / "plain.md").write_text("You are the router.")
    plain = manifest_for(
        tmp_path, llama_path, '[[model.prefix]]\nname = "a"\nfile = "plain.md"\n', name="p.toml"
    )
    cli("warm", "--manifest", path, code=0)
    out = cli("warm", "--manifest", plain, code=0).output  # the same pin: present, not prefilled
    assert "1 present" in out and "\ufeff" not in cli("ls", code=0).output, out


def test_a_byte_order_mark_at_the_start_of_the_manifest_is_dropped(tmp_path, llama_path):
    path = manifest_for(tmp_path, llama_path, '[[model.prefix]]\nname = "a"\ntext = "hi"\n')
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert [p.name for p in load_manifest(path).models[0].prefixes] == ["a"]
