"""A real daemon watching a manifest whose model `path` is edited: nothing is purged until the new
path resolves, and a model moved to an identical copy keeps its entries (same keys) under the new
name, with no prefill."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from helpers import CLASSIFY, Proc, manifest_for, serving

from kvstore.wire.daemon_client import DaemonClient

PINS = (
    '[[model.prefix]]\nname = "router"\nfile = "router.md"\n\n'
    '[[model.prefix]]\nname = "writer"\nmessages = [{ role = "system", content = '
    '"You are the writer. Reply in short, kind sentences with the next step first." }]\n'
)


@pytest.fixture
def watched(tmp_path, llama_path):
    model = tmp_path / "model"
    shutil.copytree(llama_path, model)
    (tmp_path / "router.md").write_text(CLASSIFY)
    manifest = manifest_for(tmp_path, model, PINS, name="pins.toml")
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    (home / "settings.toml").write_text("debounce = 0.2\npoll_interval = 1.0\n")
    d = Proc(home, "--manifest", str(manifest), log=tmp_path / "daemon.log")
    d.root, d.model, d.manifest = tmp_path, model, manifest
    with serving(d):
        yield d


def entries(d: Proc) -> dict[str, dict]:
    with DaemonClient(d.home) as c:
        return {e["label"]: e for e in c.raw("ls")}


def point_at(d: Proc, model: Path) -> dict:
    """Save the manifest with `model` as its path (an editor's atomic save); the warm it causes."""
    at = d.request("stats")["daemon"]["last_warm"]["at"]
    tmp = manifest_for(d.root, model, PINS, name="pins.tmp")
    os.replace(tmp, d.manifest)
    return d.next_warm(at)


def same_entries(before: dict[str, dict], after: dict[str, dict]) -> None:
    assert set(after) == set(before) == {"router", "writer"}
    for label, e in after.items():
        assert (e["key"], e["created"]) == (before[label]["key"], before[label]["created"])


def test_a_path_typo_keeps_the_pins_and_fixing_it_prefills_nothing(watched):
    before = entries(watched)
    typo = watched.root / "modle"
    w = point_at(watched, typo)
    assert (w["purged"], w["warmed"], w["failed"]) == (0, 0, 2), watched.text()
    same_entries(before, entries(watched))
    watched.wait_log(f"model '{typo}': no such directory")
    assert "model removed from the manifest" not in watched.text()

    w = point_at(watched, watched.model)  # the typo fixed
    assert (w["purged"], w["warmed"], w["present"], w["models_loaded"]) == (0, 0, 2, 0)
    same_entries(before, entries(watched))


def test_a_model_moved_to_an_identical_copy_keeps_its_entries(watched):
    before = entries(watched)
    moved = watched.root / "elsewhere" / "model"
    shutil.copytree(watched.model, moved)
    w = point_at(watched, moved)
    assert (w["purged"], w["warmed"], w["present"], w["models_loaded"]) == (0, 0, 2, 0)
    after = entries(watched)
    same_entries(before, after)
    assert {e["model"] for e in after.values()} == {str(moved)}  # re-owned under the new name
    watched.wait_log("under the model's new name")
    # and from then on it is simply present: a warm request neither renames nor prefills
    with DaemonClient(watched.home) as c:
        report = c.raw("warm", {"manifest": str(watched.manifest)}, timeout=None)["reports"][0]
    assert (report["warmed"], len(report["purged"])) == (0, 0)
    same_entries(before, entries(watched))
