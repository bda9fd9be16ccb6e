"""Manifests warmed through the daemon are remembered in the home (issue 10 item 10): after a
real restart the daemon reconciles and watches each of them; `kvstore manifests` lists them and
`kvstore manifests remove` forgets one; a registered manifest that is gone is reported, not
fatal."""

from __future__ import annotations

import json

from helpers import TWO_PINS, Proc, cli, manifest_for, serving, wait_for

THIRD = """
[[model.prefix]]
name = "third"
messages = [{ role = "system", content = "You are the third stage: check the plan twice." }]
"""


def _cli(home, *args: str, ok: bool = True):
    r = cli(*args, "--home", home)
    assert (r.exit_code == 0) == ok, r.output
    return r


def _listed(home) -> list[dict]:
    return json.loads(_cli(home, "manifests", "--json").output)


def _wait_label(d: Proc, label: str, timeout: float = 60.0) -> None:
    wait_for(lambda: label in {e["label"] for e in d.request("ls")}, timeout,
             lambda: f"pin {label!r} to warm:\n{d.text()}")  # fmt: skip


def test_a_manifest_warmed_through_the_daemon_is_kept_true_after_a_restart(
    tmp_path, llama_path, kv_home
):
    manifest = manifest_for(tmp_path, llama_path, TWO_PINS).resolve()
    log = tmp_path / "daemon.log"
    with serving(Proc(kv_home, log=log), warm=False):
        out = _cli(kv_home, "warm", "--manifest", str(manifest)).output
        assert "2 warmed" in out, out
        assert _listed(kv_home) == [
            {"path": str(manifest), "added": _listed(kv_home)[0]["added"], "present": True,
             "watched": True}
        ]  # fmt: skip

    with serving(Proc(kv_home, log=log), warm=False) as d:
        w = d.wait_warm()  # before the registry, a restarted daemon never warmed it again
        assert w["manifest"] == str(manifest) and w["cause"] == "boot", d.text()
        assert d.request("manifests")["watched"] == [str(manifest)]
        # ...and watches it: an edit after the restart is warmed
        manifest.write_text(manifest.read_text() + THIRD)
        _wait_label(d, "third")

        r = _cli(kv_home, "manifests", "remove", str(manifest))
        assert "no longer watches it" in r.output and "pins stay stored" in r.output
        d.wait_log(f"no longer watching manifest {manifest}")
        assert d.request("manifests")["watched"] == []
        assert _listed(kv_home) == []
        r = _cli(kv_home, "manifests", "remove", str(manifest), ok=False)
        assert "not a registered manifest" in r.output
        assert {e["label"] for e in d.request("ls")} == {"classify", "synthesize", "third"}


def test_a_registered_manifest_that_is_gone_is_reported_not_fatal(tmp_path, llama_path, kv_home):
    manifest = manifest_for(tmp_path, llama_path, TWO_PINS, name="gone.toml").resolve()
    log = tmp_path / "daemon.log"
    with serving(Proc(kv_home, log=log), warm=False):
        _cli(kv_home, "warm", "--manifest", str(manifest))
    manifest.unlink()

    with serving(Proc(kv_home, log=log), warm=False) as d:
        d.wait_log(f"registered manifest {manifest} is gone")
        assert d.request("ping")["pid"] == d.pid  # it serves regardless
        r = _cli(kv_home, "manifests")
        assert "gone     watched" in r.output and str(manifest) in r.output, r.output
    # Without a daemon, removal edits the registry directly.
    r = _cli(kv_home, "manifests", "remove", str(manifest))
    assert "forgot" in r.output and "no longer watches" not in r.output
    assert _listed(kv_home) == []


def test_a_registration_is_on_disk_when_it_returns_file_then_rename_then_directory(tmp_path):
    import os
    import stat
    from unittest import mock

    from kvstore.home.registry import REGISTRY_NAME, register, registered

    home = tmp_path / "home"
    home.mkdir()
    manifest = manifest_for(tmp_path, tmp_path / "model", TWO_PINS)
    events: list[tuple] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        st = os.fstat(fd)
        events.append(("fsync", "dir" if stat.S_ISDIR(st.st_mode) else "file", st.st_ino))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.fspath(dst)))
        return real_replace(src, dst)

    with mock.patch("os.fsync", fsync), mock.patch("os.replace", replace):
        assert register(home, manifest)
    path = home / REGISTRY_NAME
    assert events == [
        ("fsync", "file", path.stat().st_ino),  # the new list's bytes, before it takes the name
        ("replace", os.fspath(path)),
        ("fsync", "dir", home.stat().st_ino),  # the rename itself, before register returns
    ]
    assert [r.path for r in registered(home)] == [manifest.resolve()]
    assert [p.name for p in home.iterdir() if p.name.startswith(f".{REGISTRY_NAME}")] == []
