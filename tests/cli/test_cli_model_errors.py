"""A model that cannot be used is said once, in one line: the path as resolved, a download offered
only for a hub id, transformers' own message for a config.json it rejects."""

from __future__ import annotations

import json

import pytest
from helpers import cli, manifest_for

PIN = '[[model.prefix]]\nname = "a"\ntext = "hi"\n'


def _errors(output: str, needle: str) -> list[str]:
    return [ln for ln in output.splitlines() if needle in ln]


def test_a_missing_local_model_is_said_once_naming_the_resolved_path(tmp_path, monkeypatch):
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # relative to the manifest, not to here
    manifest = manifest_for(tmp_path, "./nope", PIN)
    result = cli("warm", "--manifest", manifest)
    assert result.exit_code == 1, result.output
    said = _errors(result.output, "no such directory")
    assert len(said) == 1, result.output  # once: not logged and then raised again
    assert str(tmp_path / "nope") in said[0] and "hf download" not in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("given", ["./nope", "../nope/x", "~/nope-kvstore-model"])
def test_a_plainly_local_path_is_never_offered_a_download(tmp_path, monkeypatch, given):
    monkeypatch.chdir(tmp_path)
    result = cli("fingerprint", given)
    assert result.exit_code == 1, result.output
    line = result.output.strip()
    assert len(line.splitlines()) == 1 and "hf download" not in line, line
    resolved = (tmp_path / given).resolve() if given.startswith(".") else None
    if resolved is not None:
        assert str(tmp_path / given) in line or str(resolved) in line, line


def test_a_hub_id_not_in_the_cache_is_offered_its_download(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    result = cli("fingerprint", "org/no-such-model")
    assert result.exit_code == 1, result.output
    line = result.output.strip()
    assert "`hf download org/no-such-model`" in line and str(tmp_path / "org") in line, line


def test_a_config_transformers_rejects_is_one_line(tmp_path, model_copy):
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers before 5 does not validate config.json field types")
    config = json.loads((model_copy / "config.json").read_text())
    config["tie_word_embeddings"] = "yes"  # a bool field given a string
    (model_copy / "config.json").write_text(json.dumps(config))
    result = cli("warm", "--manifest", manifest_for(tmp_path, model_copy, PIN))
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    said = _errors(result.output, "tie_word_embeddings")
    assert len(said) == 1, result.output
    assert str(model_copy) in said[0] and str(model_copy / "config.json") in said[0]
    assert "expected bool, got str" in said[0]  # transformers' own words


def test_import_with_a_config_transformers_rejects_is_one_line(tmp_path, model_copy, kv_home):
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers before 5 does not validate config.json field types")
    cli("warm", "--manifest", manifest_for(tmp_path, model_copy, PIN), code=0)
    key = json.loads(cli("ls", "--json", code=0).output)[0]["key"]
    exported = tmp_path / "a.safetensors"
    cli("export", key, exported, code=0)
    config = json.loads((model_copy / "config.json").read_text())
    config["tie_word_embeddings"] = "yes"
    (model_copy / "config.json").write_text(json.dumps(config))
    result = cli("import", exported, "--model", model_copy, "--prompt", "hi", "--label", "b")
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert str(model_copy / "config.json") in result.output
    assert "expected bool, got str" in result.output
