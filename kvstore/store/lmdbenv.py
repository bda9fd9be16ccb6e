"""The LMDB environment: one per file per process, shared by Stores of one path, with the gate
that keeps this process's readers off while a write or a map resize runs."""

from __future__ import annotations

import errno
import os
import resource
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lmdb

from kvstore.errors import StoreError


class Gate:
    """Many read transactions, or one writer: LMDB's set_mapsize needs no other transaction of
    this process open, and py-lmdb's abort of a write transaction that hit MapFullError waits for
    every other thread's operations to drain (readers that keep starting ones starve it: a hang
    seen with lmdb 3.0). The daemon reads on connection threads while it writes, so a write
    transaction and any resize run with this process's readers held off."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = 0
        self._resizing = False

    @contextmanager
    def txn(self) -> Iterator[None]:
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._open += 1
        try:
            yield
        finally:
            with self._cond:
                self._open -= 1
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._resizing = True
            while self._open:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._resizing = False
                self._cond.notify_all()


# LMDB allows one open environment per file per process: Stores of one path share it (and its
# resize gate).
ENVS: dict[str, list] = {}  # resolved path -> [env, refcount, readonly, gate]


# An environment must not be used across fork(): a child starts with none.
os.register_at_fork(after_in_child=ENVS.clear)


def open_env(path: Path, *, readonly: bool, map_size: int, max_readers: int) -> lmdb.Environment:
    key = str(path.resolve())
    held = ENVS.get(key)
    if held is not None:
        if held[2] and not readonly:
            raise StoreError(f"{path}: already open read-only in this process; close it first")
        held[1] += 1
        return held[0]
    env = lmdb.open(
        key,
        map_size=map_size,
        max_dbs=8,  # meta, blob; bmeta, bblob, kids, bstat (learned blocks)
        readonly=readonly,
        create=not readonly,
        writemap=False,
        sync=True,
        metasync=True,
        max_readers=max_readers,
    )
    ENVS[key] = [env, 1, readonly, Gate()]
    return env


def close_env(path: Path) -> None:
    key = str(path.resolve())
    held = ENVS.get(key)
    if held is None:
        return
    held[1] -= 1
    if held[1] <= 0:
        del ENVS[key]
        held[0].close()


def space_hint(path: Path) -> str:
    """LMDB reports a short write (disk full, a file size limit) as a bare EIO: name the
    likely causes, with the figures to check them."""
    try:
        free = shutil.disk_usage(path).free
        soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    except (OSError, ValueError):
        return ""
    limit = "" if soft == resource.RLIM_INFINITY else f", file size limit {soft} bytes"
    return f" (disk full or a file size limit? {free // 2**20} MiB free there{limit})"


def lmdb_errno(e: Exception) -> int | None:
    """The OS error number behind an lmdb.Error: py-lmdb raises DiskError for ENOSPC and a plain
    Error whose text ends in the OS's message for the rest (EIO: "path: Input/output error")."""
    if isinstance(e, lmdb.DiskError):
        return errno.ENOSPC
    if len(e.args) >= 2 and isinstance(e.args[1], int) and e.args[1] > 0:  # the cffi build
        return e.args[1]
    text = str(e.args[0]) if e.args else ""
    for code in errno.errorcode:
        if text.endswith(": " + os.strerror(code)):
            return code
    return None
