"""The LMDB store: entry meta (msgpack) and blobs (safetensors bytes) under 32-byte keys.

One writer (the daemon, or the CLI when no daemon runs) and many readers. Every write goes through
`_write`, the one place that grows the map; readers and writers recover from MapResizedError
(another process grew the map) by adopting its size. Blob bytes read
through `buffers=True` are checksummed and decoded (copied into mlx memory) inside their
transaction. The meta record lives in `kvstore.store.entry`, the environment in
`kvstore.store.lmdbenv`.

This module holds the environment and its two transaction paths; what runs in them is split by
responsibility: reads in `kvstore.store.read`, writes in `kvstore.store.write`, check and stats in
`kvstore.store.admin`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb

from kvstore.errors import StoreError
from kvstore.settings import DEFAULTS, STORE_DIR
from kvstore.store.admin import StoreAdmin
from kvstore.store.entry import DEFAULT_QUANTIZED_KV_START, SCHEMA_VERSION, EntryMeta, blob_checksum
from kvstore.store.lmdbenv import ENVS, close_env, lmdb_errno, open_env, space_hint
from kvstore.store.read import StoreReads
from kvstore.store.write import StoreWrites, model_location, with_model_location

__all__ = [
    "DEFAULT_QUANTIZED_KV_START",
    "SCHEMA_VERSION",
    "EntryMeta",
    "Store",
    "blob_checksum",
    "model_location",
    "with_model_location",
]


class Store(StoreReads, StoreWrites, StoreAdmin):
    """One LMDB environment in `home/store`. Not to be carried across fork()."""

    def __init__(
        self,
        home: str | Path,
        *,
        readonly: bool = False,
        map_size: int = DEFAULTS["map_size"],
        max_map_size: int = DEFAULTS["max_map_size"],
        max_readers: int = 256,
    ):
        self.path = Path(home) / STORE_DIR
        self.readonly = readonly
        self.max_map_size = max_map_size
        self._pid = os.getpid()
        if readonly and not (self.path / "data.mdb").is_file():
            raise StoreError(f"{self.path}: no store here (run `kvstore warm` or start the daemon)")
        if not readonly:
            try:
                self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
            except OSError as e:
                raise StoreError(
                    f"{self.path}: cannot create the store directory: {e.strerror or e}",
                    errno=e.errno,
                ) from None
        try:
            self.env = open_env(
                self.path, readonly=readonly, map_size=map_size, max_readers=max_readers
            )
            self._gate = ENVS[str(self.path.resolve())][3]
            self._meta = self.env.open_db(b"meta", create=not readonly)
            self._blob = self.env.open_db(b"blob", create=not readonly)
        except lmdb.Error as e:
            raise StoreError(
                f"{self.path}: cannot open the LMDB store: {e}", errno=lmdb_errno(e)
            ) from None
        if not readonly:
            self.env.reader_check()
        self.on_commit: list[Callable[[EntryMeta], None]] = []  # after each put (the fleet queue)

    def close(self) -> None:
        if self.env is not None:
            close_env(self.path)
            self.env = None

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_pid(self) -> None:
        if os.getpid() != self._pid:
            raise StoreError(f"{self.path}: an LMDB environment cannot be used across fork()")

    def _write(self, fn: Callable[[lmdb.Transaction], Any]) -> Any:
        """The one write path: a transaction, retried after doubling the map when it is full or
        adopting the size another process grew it to."""
        self._check_pid()
        if self.readonly:
            raise StoreError(f"{self.path}: opened read-only")
        with self._gate.exclusive():
            return self._write_locked(fn)

    def _write_locked(self, fn: Callable[[lmdb.Transaction], Any]) -> Any:
        adopted = 0
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    return fn(txn)
            except lmdb.MapResizedError:
                # Another process grew the map past ours: adopt its size (the gate holds this
                # process's readers off) and retry, as readers do.
                adopted += 1
                if adopted > 3:
                    raise StoreError(
                        f"{self.path}: the map keeps being resized under this writer"
                    ) from None
                self.env.set_mapsize(0)
            except lmdb.MapFullError:
                size = self.env.info()["map_size"]
                if size * 2 > self.max_map_size:
                    raise StoreError(
                        f"{self.path}: store map is full at {size} bytes and the cap "
                        f"max_map_size={self.max_map_size} is reached; evict entries or raise it"
                    ) from None
                self.env.set_mapsize(size * 2)  # no transaction of this process is open
            except lmdb.Error as e:  # ENOSPC and EIO come from put or commit: keep the errno
                raise StoreError(
                    f"{self.path}: write failed: {e}{space_hint(self.path)}", errno=lmdb_errno(e)
                ) from None
            except OSError as e:
                raise StoreError(
                    f"{self.path}: write failed: {e}{space_hint(self.path)}", errno=e.errno
                ) from None

    def _read(self, fn: Callable[[lmdb.Transaction], Any], *, buffers: bool = False) -> Any:
        self._check_pid()
        for _ in range(3):
            try:
                with self._gate.txn(), self.env.begin(buffers=buffers) as txn:
                    return fn(txn)
            except lmdb.MapResizedError:
                with self._gate.exclusive():
                    self.env.set_mapsize(0)  # adopt the size another process grew the map to
            except lmdb.ReadersFullError:
                # Every slot is held, often by readers that died: reader_check() (the daemon
                # runs it periodically) frees those. Say so instead of a bare lmdb error.
                raise StoreError(
                    f"{self.path}: all LMDB reader slots are in use "
                    f"({self.env.max_readers()} max_readers); dead readers are cleared by the "
                    "daemon's periodic reader_check, or close some readers"
                ) from None
        raise StoreError(f"{self.path}: the map keeps being resized under this reader")

    def reader_check(self) -> int:
        return self.env.reader_check()
