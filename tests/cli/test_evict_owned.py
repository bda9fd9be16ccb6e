"""Evicting a pin a manifest owns says which manifest keeps it and when it comes back."""

from __future__ import annotations

import pytest
from helpers import TWO_PINS, Proc, cli, manifest_for, serving

from kvstore.home.registry import canonical, register


def test_evict_without_a_daemon_names_the_owning_manifest(llama_path, kv_home, tmp_path):
    manifest = manifest_for(tmp_path, llama_path, TWO_PINS)
    path = canonical(manifest)
    cli("warm", "--manifest", str(manifest), code=0)
    out = cli("evict", "--label", "classify", code=0).output
    assert "evicted 1 entry" in out
    assert (
        f"pin 'classify' came from manifest {path}, which no daemon watches: it stays evicted "
        f"until `kvstore warm --manifest {path}`"
    ) in out, out
    assert "synthesize" not in out

    cli("warm", "--manifest", str(manifest), code=0)
    register(kv_home, manifest)  # what a warm through a daemon does: every start reconciles it
    out = cli("evict", "--all", code=0).output
    for name in ("classify", "synthesize"):
        assert (
            f"pin {name!r} is kept by manifest {path}: the daemon re-warms it when it starts "
            f"(`kvstore warm --manifest {path}` now); remove it from the manifest to drop it "
            "for good"
        ) in out, out


@pytest.mark.slow
def test_evict_through_the_daemon_names_the_watched_manifest(llama_path, tmp_path):
    home = tmp_path / "h"
    manifest = manifest_for(tmp_path, llama_path, TWO_PINS)
    path = canonical(manifest)
    with serving(Proc(home, "--manifest", str(manifest), log=tmp_path / "d.log")) as d:
        out = cli("evict", "--label", "classify", "--home", str(home), code=0).output
        assert (
            f"pin 'classify' is kept by manifest {path}: the daemon re-warms it at its next "
            f"reconcile (a restart, a manifest edit or `kvstore warm --manifest {path}`); "
            "remove it from the manifest to drop it for good"
        ) in out, out
        assert "evicted pin 'classify' is kept by manifest" in d.text()
        out = cli("warm", "--manifest", str(manifest), "--home", str(home), code=0).output
        assert "1 warmed, 1 present" in out, out  # as said: the reconcile brings it back
