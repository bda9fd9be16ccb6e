"""A full disk, injected on the real call: the store's LMDB environment, wrapped so that writing
a blob raises what py-lmdb raises for ENOSPC (lmdb.DiskError). Everything else is the real env.

Used in-process (`install()` under a monkeypatch) and in a daemon child (`DAEMON_CODE`); and a
real small tmpfs that fills up (`mounted_tmpfs`).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lmdb
import pytest

HERE = Path(__file__).parent


class _Txn:
    def __init__(self, txn, env: FullDiskEnv):
        self._txn, self._env = txn, env

    def __getattr__(self, name):
        return getattr(self._txn, name)

    def __enter__(self):
        self._txn.__enter__()
        return self

    def __exit__(self, *exc):
        return self._txn.__exit__(*exc)

    def put(self, key, value, *args, db=None, **kw):
        if db is not None and db is self._env.blob_db:
            raise lmdb.DiskError(f"{self._env.path()}: No space left on device")
        return self._txn.put(key, value, *args, db=db, **kw)


class FullDiskEnv:
    def __init__(self, env):
        self._env = env
        self.blob_db = None

    def __getattr__(self, name):
        return getattr(self._env, name)

    def open_db(self, name, *args, **kw):
        db = self._env.open_db(name, *args, **kw)
        if name == b"blob":
            self.blob_db = db
        return db

    def begin(self, *args, write=False, **kw):
        txn = self._env.begin(*args, write=write, **kw)
        return _Txn(txn, self) if write else txn


def full_open_env(real):
    def open_env(*args, **kw):
        return FullDiskEnv(real(*args, **kw))

    return open_env


DAEMON_CODE = f"""
import sys
sys.path.insert(0, {str(HERE)!r})
import kvstore.store.store, kvstore.warm.warm
from full_disk import full_open_env
kvstore.store.store.open_env = full_open_env(kvstore.store.store.open_env)
real_prefill = kvstore.warm.warm.prefill_pin
def counted(*a, **kw):
    print("INJECTED: prefill", file=sys.stderr, flush=True)
    return real_prefill(*a, **kw)
kvstore.warm.warm.prefill_pin = counted
from kvstore.cli.main import main
main(["daemon", *sys.argv[1:]])
"""


@contextmanager
def mounted_tmpfs(mnt: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of `size` (e.g. "8m") mounted at `mnt`: a disk that really fills up. Skips
    the test where this box cannot mount one."""
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
