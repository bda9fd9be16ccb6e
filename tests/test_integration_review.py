"""Where merged features meet: bugs found in the integration review of issues 9-13, each with the
test that failed before its fix."""

from __future__ import annotations

import datetime as dt
import shutil
import threading
from dataclasses import replace
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


def test_an_adopted_app_pin_that_is_clock_bound_is_rewarmed_at_midnight(kv_home, tmp_path):
    """The midnight watch used to count only entries a manifest stored itself (source
    "manifest"): a clock-bound pin an app stored first and the manifest adopted was never
    prepared for the next day, nor rolled over, so the first request after midnight missed it."""
    from test_daywatch import DAY_TEMPLATE, PINS, Clock, run_now

    from daemon.daywatch import DayWatch
    from daemon.upkeep import Upkeep
    from kvstore.settings import load_settings
    from kvstore.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "m", chat_template=DAY_TEMPLATE)
    manifest = manifest_for(tmp_path, model, PINS)
    clock = Clock(dt.datetime(2026, 3, 14, 12, 0))
    me = f"manifest:{manifest}"
    with Store(kv_home) as store:
        upkeep = Upkeep(store, kv_home, load_settings(kv_home), threading.Event(), clock=clock)
        upkeep.reconcile([manifest], cause="boot")
        (meta,) = store.metas()
        assert owners(meta) == [me]

        def as_adopted(m):  # what an app's pin() then the manifest's adoption leave
            extra = dict(m.extra, source="pin", manifest=None, owners=[APP, me])
            return replace(m, extra=extra)

        store.edit_meta({meta.key: as_adopted})
        watch = DayWatch(upkeep, lambda: [manifest], run_now, clock=clock)
        assert watch.tick() is None
        clock.now = dt.datetime(2026, 3, 14, 23, 50)
        fut = watch.tick()
        assert fut is not None and watch.due(clock.now) is None  # tomorrow's is prepared
        assert sorted(m.extra["valid_date"] for m in store.metas()) == ["2026-03-14", "2026-03-15"]
        clock.now = dt.datetime(2026, 3, 15, 0, 1)
        assert watch.tick() is not None  # rolled over: the manifest lets go of yesterday's
        by_date = {m.extra["valid_date"]: owners(m) for m in store.metas()}
        assert by_date == {"2026-03-14": [APP], "2026-03-15": [me]}
        assert watch.tick() is None
