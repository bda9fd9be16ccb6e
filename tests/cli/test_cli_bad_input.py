"""Bad input to `export`, `fingerprint` and `verify --deep` is a one-line answer, not a traceback
or a refusal of what the help promises."""

from __future__ import annotations

import json

import pytest
from helpers import TWO_PINS, cli, manifest_for

from kvstore.errors import ManifestError
from kvstore.home.registry import register
from kvstore.pins.manifest import load_manifest


def test_export_into_a_missing_folder_names_the_folder(warmed, tmp_path):
    key = json.loads(cli("ls", "--json", code=0).output)[0]["key"]
    out = cli("export", key, tmp_path / "missing" / "f.safetensors", code=1).output
    assert out.count("\n") == 1 and "Traceback" not in out
    assert f"{tmp_path / 'missing'}: no such folder" in out


def test_fingerprint_refuses_the_kv_bits_a_manifest_refuses(llama_path, tmp_path):
    out = cli("fingerprint", llama_path, "--kv-bits", "7", code=2).output
    assert "--kv-bits: must be an integer, one of 2, 3, 4, 5, 6, 8; got 7" in out
    manifest = manifest_for(tmp_path, llama_path, TWO_PINS, extra="kv_bits = 7")
    refused = "'kv_bits': must be an integer, one of 2, 3, 4, 5, 6, 8; got 7"
    with pytest.raises(ManifestError, match=refused):
        load_manifest(manifest)
    out = cli("fingerprint", llama_path, "--kv-group-size", "48", code=2).output
    assert "--kv-group-size: must be an integer, one of 32, 64, 128; got 48" in out
    cli("fingerprint", llama_path, "--kv-bits", "8", code=0)


def test_verify_deep_without_manifest_checks_the_registered_ones(warmed, kv_home):
    """The help says --deep defaults to the home's manifests: a registered manifest counts."""
    register(kv_home, warmed)
    out = cli("verify", "--deep", code=0).output
    assert "re-prefilled matches its stored KV" in out
    assert "2 entries ok" in out
