"""Bad input to `export`, `fingerprint` and `verify --deep` is a one-line answer, not a traceback
or a refusal of what the help promises."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from helpers import TWO_PINS, manifest_for

from kvstore.cli.main import main
from kvstore.errors import ManifestError
from kvstore.pins.manifest import load_manifest
from kvstore.pins.registry import register


def cli(*args, code=0):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == code, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.output


@pytest.fixture
def warmed(llama_path, kv_home, tmp_path):
    manifest = manifest_for(tmp_path, llama_path, TWO_PINS)
    assert "2 warmed" in cli("warm", "--manifest", manifest)
    return manifest


def test_export_into_a_missing_folder_names_the_folder(warmed, tmp_path):
    key = json.loads(cli("ls", "--json"))[0]["key"]
    out = cli("export", key, tmp_path / "missing" / "f.safetensors", code=1)
    assert out.count("\n") == 1 and "Traceback" not in out
    assert f"{tmp_path / 'missing'}: no such folder" in out


def test_fingerprint_refuses_the_kv_bits_a_manifest_refuses(llama_path, tmp_path):
    out = cli("fingerprint", llama_path, "--kv-bits", "7", code=2)
    assert "--kv-bits: must be an integer, one of 2, 3, 4, 5, 6, 8; got 7" in out
    manifest = manifest_for(tmp_path, llama_path, TWO_PINS, extra="kv_bits = 7")
    refused = "'kv_bits': must be an integer, one of 2, 3, 4, 5, 6, 8; got 7"
    with pytest.raises(ManifestError, match=refused):
        load_manifest(manifest)
    out = cli("fingerprint", llama_path, "--kv-group-size", "48", code=2)
    assert "--kv-group-size: must be an integer, one of 32, 64, 128; got 48" in out
    cli("fingerprint", llama_path, "--kv-bits", "8")


def test_verify_deep_without_manifest_checks_the_registered_ones(warmed, kv_home):
    """The help says --deep defaults to the home's manifests: a registered manifest counts."""
    register(kv_home, warmed)
    out = cli("verify", "--deep")
    assert "re-prefilled matches its stored KV" in out
    assert "2 entries ok" in out
