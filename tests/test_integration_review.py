"""Where merged features meet: bugs found in the integration review of issues 9-13, each with the
test that failed before its fix."""

from __future__ import annotations

import shutil
from unittest import mock

import mlx.core as mx
import pytest
from fleet_helpers import box, cli
from helpers import TWO_PINS, manifest_for
from mlx_lm import load

from kvstore import codec
from kvstore.identity import model_fingerprint
from kvstore.keys import entry_key, pack_tokens
from kvstore.ownership import APP, owners
from kvstore.prefill import prefill
from kvstore.store import Store

pytest_plugins = ["fleet_fixtures"]


@pytest.mark.slow
def test_pulled_runtime_entry_records_this_boxs_model_dir_not_the_other_boxs(
    s3, llama_path, tmp_path
):
    """`kvstore remote pull` of an entry another box stored (not one of this box's manifest pins)
    used to keep that box's extra: its model_dir (so `evict --stale` here judged the entry by the
    other box's path, and deleted it once that path was gone) and its manifest owners."""
    a_model = shutil.copytree(llama_path, tmp_path / "box_a" / "models" / "llama")
    b_model = shutil.copytree(llama_path, tmp_path / "box_b" / "models" / "llama")
    a, b = box(tmp_path / "a", s3), box(tmp_path / "b", s3)
    model, _ = load(str(a_model))
    tokens = list(range(3, 40))
    key = entry_key(model_fingerprint(a_model).digest, tokens)
    blob = codec.encode(prefill(model, tokens), {"model": str(a_model), "tokenizer_config": "{}"})
    a_manifest = str(tmp_path / "box_a" / "manifest.toml")
    extra = {"source": "manifest", "manifest": a_manifest, "owners": [f"manifest:{a_manifest}"]}
    with Store(a) as sa:  # box A: a pin of one of A's manifests, with A's locations
        sa.put(key, blob, tokens=pack_tokens(tokens), label="a-only", pinned=True,
               model=str(a_model), classes=["KVCache"] * len(model.layers),
               extra=extra)  # fmt: skip
        assert sa.get_meta(key).extra["model_dir"] == str(a_model)
    assert "1 uploaded" in cli("remote", "push", "--home", str(a)).output

    manifest = manifest_for(tmp_path, b_model, TWO_PINS)
    r = cli("remote", "pull", "--manifest", str(manifest), "--home", str(b))
    assert r.exit_code == 0 and "1 fetched, 2 not on the remote" in r.output, r.output
    with Store(b, readonly=True) as sb:
        meta = sb.get_meta(key)
    assert meta.extra["model_dir"] == str(b_model.resolve())
    assert owners(meta) == [APP] and meta.extra.get("manifest") is None
    assert meta.extra["origin"] == "remote" and not meta.pinned  # no manifest here pins it

    shutil.rmtree(a_model)  # box A's model is not on box B (its parent directory is)
    r = cli("evict", "--stale", "--home", str(b))
    assert r.exit_code == 0, r.output
    with Store(b, readonly=True) as sb:
        assert sb.get_meta(key) is not None, r.output  # B's model is intact: not stale


@pytest.mark.slow
def test_kv_made_with_other_mlx_versions_is_prefilled_not_fetched(s3, llama_path, tmp_path):
    """The fingerprint leaves mlx / mlx-lm versions out (the upgrade canary checks them): a warm
    used to fetch another runtime's KV and record it under this box's runtime, so after an
    upgrade the canary's dropped entries came straight back from the fleet, labelled as new."""
    a, b = box(tmp_path / "a", s3), box(tmp_path / "b", s3)
    manifest = str(manifest_for(tmp_path, llama_path, TWO_PINS))
    old = {"mlx": "0.0.1", "mlx_lm": "0.0.1"}
    with mock.patch("kvstore.warm.runtime_versions", return_value=old):  # box A before upgrade
        assert "2 warmed" in cli("warm", "--manifest", manifest, "--home", str(a)).output
    assert "2 uploaded" in cli("remote", "push", "--home", str(a)).output
    r = cli("warm", "--manifest", manifest, "--home", str(b))
    assert r.exit_code == 0 and "2 warmed" in r.output and "0 fetched" in r.output, r.output
    assert "made with mlx 0.0.1, mlx_lm 0.0.1; this box runs" in r.output
    with Store(b, readonly=True) as sb:
        assert {m.extra["runtime"]["mlx"] for m in sb.metas()} == {mx.__version__}
    r = cli("remote", "pull", "--manifest", manifest, "--home", str(box(tmp_path / "c", s3)))
    assert "0 fetched" in r.output and "made with mlx 0.0.1" in r.output, r.output
