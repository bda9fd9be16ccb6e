"""Every file kvstore creates in a home is 0600 and every folder it creates 0700, whatever the
umask and whatever the home's own mode (issue 43 item 10): an existing home keeps its mode, so
the files in it are what must keep other users out. One real run of each writer: a daemon with
its log file, `kvstore warm` and an eviction through it, and a client hydrating without one."""

from __future__ import annotations

import os
import stat

from helpers import TWO_PINS, Proc, cli, manifest_for, serving
from mlx_lm.models.cache import LRUPromptCache

from kvstore.client import hydrate


def modes(home) -> dict[str, int]:
    return {
        str(p.relative_to(home)): stat.S_IMODE(p.lstat().st_mode) for p in sorted(home.rglob("*"))
    }


def test_every_file_kvstore_creates_in_a_home_is_0600(llama_path, tmp_path):
    home = tmp_path / "shared-home"
    home.mkdir()
    home.chmod(0o755)  # a home given as an existing directory keeps its mode
    old = os.umask(0o022)
    try:
        manifest = manifest_for(tmp_path, llama_path, TWO_PINS)
        d = Proc(home, "--log-file", str(home / "daemon.log"), log=tmp_path / "daemon.out")
        with serving(d, warm=False):
            cli("warm", "--manifest", manifest, "--home", home, code=0)  # registers it
            cli("evict", "--label", "classify", "--home", home, code=0)
            cli("stats", "--home", home, code=0)
        report = hydrate(LRUPromptCache(max_size=10), "m", llama_path, home=home)
        assert report.entries == 1, report
    finally:
        os.umask(old)
    found = modes(home)
    for name in ("store/data.mdb", "store/lock.mdb", "filehash.msgpack", "manifests.json",
                 "evicted.msgpack", "daemon.log"):  # fmt: skip
        assert name in found, found
    wrong = {
        name: oct(mode)
        for name, mode in found.items()
        if mode != (0o700 if (home / name).is_dir() else 0o600)
    }
    assert not wrong, f"not owner-only: {wrong}"
    assert stat.S_IMODE(home.stat().st_mode) == 0o755
