"""A full disk stops a warm at the first ENOSPC: no more prefills, the rest named, exit 1."""

from __future__ import annotations

import os
import shutil

import pytest
from full_disk import DAEMON_CODE, full_open_env, mounted_tmpfs
from helpers import TWO_PINS, Proc, cli, manifest_for, serving

import kvstore.store.store
import kvstore.warm.warm
from kvstore.store.store import Store


def _assert_stopped(r, *, why: str = "the disk is full") -> None:
    assert r.exit_code == 1, r.output
    err = r.output.strip().splitlines()[-1]
    assert f"{why}, so warming stopped at pin 'classify'" in err, r.output
    assert "left unwarmed: 'classify', 'synthesize'" in err
    assert "0 warmed, 0 present, 2 failed" in r.output


def test_warm_stops_at_the_first_enospc_without_a_daemon(
    llama_path, kv_home, tmp_path, monkeypatch
):
    manifest = manifest_for(tmp_path, llama_path, TWO_PINS)
    monkeypatch.setattr(
        kvstore.store.store, "open_env", full_open_env(kvstore.store.store.open_env)
    )
    prefills = []
    real = kvstore.warm.warm.prefill_pin
    monkeypatch.setattr(
        kvstore.warm.warm, "prefill_pin", lambda *a, **kw: prefills.append(1) or real(*a, **kw)
    )
    r = cli("warm", "--manifest", manifest, "--home", kv_home)
    _assert_stopped(r)
    assert "No space left on device" in r.output
    assert len(prefills) == 1


@pytest.fixture
def small_tmpfs(tmp_path):
    with mounted_tmpfs(tmp_path / "tmpfs", "4m") as mnt:
        yield mnt


def test_warm_stops_on_a_really_full_disk(llama_path, tmp_path, small_tmpfs, monkeypatch):
    # No injection: a tmpfs with 64 KiB left. LMDB reports the short write as EIO.
    home = small_tmpfs / "home"
    manifest = manifest_for(tmp_path, llama_path, TWO_PINS)
    Store(home).close()
    filler = small_tmpfs / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * (shutil.disk_usage(small_tmpfs).free - 64 * 1024))
        os.fsync(f.fileno())
    prefills = []
    real = kvstore.warm.warm.prefill_pin
    monkeypatch.setattr(
        kvstore.warm.warm, "prefill_pin", lambda *a, **kw: prefills.append(1) or real(*a, **kw)
    )
    r = cli("warm", "--manifest", manifest, "--home", home)
    _assert_stopped(r, why="the disk is full" if "No space" in r.output else "full or failing")
    assert len(prefills) == 1
    with Store(home, readonly=True) as store:
        assert store.metas() == []


# The boot held back until a warm request has registered its manifest (seen in CI: the request
# registered it before the boot looked, so the boot warmed it too and a full disk took two
# prefills). The boot warm is of the manifests that start found: none here.
LATE_BOOT_CODE = DAEMON_CODE.replace(
    "from kvstore.cli.main import main",
    """import time, kvstore.daemon.upkeep as upkeep
real_start = upkeep.Upkeep.start_remote
def late(self, ledger):
    time.sleep(2.0)
    return real_start(self, ledger)
upkeep.Upkeep.start_remote = late
from kvstore.cli.main import main""",
)


@pytest.mark.slow
@pytest.mark.parametrize("code", [DAEMON_CODE, LATE_BOOT_CODE], ids=["ready", "late-boot"])
def test_warm_through_the_daemon_stops_at_the_first_enospc(llama_path, tmp_path, code):
    home = tmp_path / "h"
    manifest = manifest_for(tmp_path, llama_path, TWO_PINS)
    with serving(Proc(home, log=tmp_path / "d.log", code=code), warm=False) as d:
        r = cli("warm", "--manifest", manifest, "--home", home)
        _assert_stopped(r)
        d.request("evict", label="none such")  # a writer job: anything queued before it is done
        assert "(boot)" not in d.text(), d.text()
        assert d.text().count("INJECTED: prefill") == 1, d.text()
        assert "warming stopped at pin 'classify'" in d.text()
