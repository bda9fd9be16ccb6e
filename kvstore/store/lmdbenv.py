"""The LMDB environment: one per file per process, shared by Stores of one path, with the gate
that keeps this process's readers off while a write or a map resize runs."""

from __future__ import annotations

import errno
import os
import resource
import shutil
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import lmdb

from kvstore.errors import StoreDamaged, StoreError


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


@dataclass
class HeldEnv:
    """An environment this process holds open, shared by every Store of its path."""

    env: lmdb.Environment
    refs: int  # Stores (and queues) of this path that have not closed it yet
    readonly: bool
    gate: Gate
    data_fd: int  # data.mdb, the file LMDB mapped (not whatever has its name later)
    need: int  # bytes the file is known to hold: its header's pages at open, or after a write

    def short(self) -> str | None:
        """Why the mapped file can no longer be read (None: it can): shorter than the pages
        this process knows it holds. LMDB never shrinks its file, so only a truncation under
        the map makes it shorter, and a read past its end would be a SIGBUS. One fstat."""
        size = os.fstat(self.data_fd).st_size
        if size >= self.need:
            return None
        return f"truncated under this process: {size} bytes where it held {self.need}"

    def grown(self) -> None:
        """After a commit of this process: the file holds the pages its newest meta counts."""
        info = self.env.info()
        self.need = max(self.need, (info["last_pgno"] + 1) * self.env.stat()["psize"])


# LMDB allows one open environment per file per process: Stores of one path share it (and its
# resize gate).
ENVS: dict[str, HeldEnv] = {}  # resolved path -> the environment held for it


def held_env(path: Path) -> HeldEnv:
    """The environment held open for `path` (open_env first)."""
    return ENVS[str(path.resolve())]


def gate_of(path: Path) -> Gate:
    """The resize gate of the environment held open for `path` (open_env first)."""
    return held_env(path).gate


# An environment must not be used across fork(): a child starts with none.
os.register_at_fork(after_in_child=ENVS.clear)


# LMDB's file header (mdb.c): each of the first two pages is a 16-byte page header (flags at
# byte 10, P_META) and an MDB_meta: magic, version, address, map size, the free and main MDB_db
# (48 bytes each on 64-bit; the free one's md_pad holds the page size), last page, txnid.
_PAGE_HEADER = struct.Struct("=8xHHHH")  # mp_pgno, mp_pad, mp_flags, mp_lower, mp_upper
_META = struct.Struct("=IIQQIHH40s48sQQ")
_P_META = 0x08
_MDB_MAGIC = 0xBEEFC0DE
_MDB_DATA_VERSION = 1


class MetaPage(NamedTuple):
    page_size: int
    last_pg: int
    txnid: int


def read_meta_page(f, offset: int) -> MetaPage | None:
    """One LMDB meta page read with a plain read (never mapped), or None where the bytes are no
    valid meta page (LMDB's own open then says what is wrong)."""
    f.seek(offset)
    raw = f.read(_PAGE_HEADER.size + _META.size)
    if len(raw) < _PAGE_HEADER.size + _META.size:
        return None
    _, flags, _, _ = _PAGE_HEADER.unpack_from(raw)
    magic, version, _, _, psize, _, _, _, _, last_pg, txnid = _META.unpack_from(
        raw, _PAGE_HEADER.size
    )
    if not flags & _P_META or magic != _MDB_MAGIC or version != _MDB_DATA_VERSION:
        return None
    if psize < 512 or psize & (psize - 1):  # LMDB's pages are powers of two
        return None
    return MetaPage(psize, last_pg, txnid)


def damaged_hint(data: Path) -> str:
    """What to do about a damaged store file: said by every refusal of one."""
    return (
        f"restore it from a backup, or move it aside (`mv {data} {data}.damaged`) and the next "
        "`kvstore warm` or daemon start makes a fresh store"
    )


# What LMDB raises on a file whose pages are not what its own writes left: a page that is no
# page, a tree that points nowhere, a header of another format. A read transaction that met one
# is flagged, and its next call says MDB_BAD_TXN; a table's record that changed says MDB_BAD_DBI
# (kvstore never drops a table). Neither comes from a healthy file, so each means damage.
DAMAGE: tuple[type[lmdb.Error], ...] = (
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.InvalidError,
    lmdb.VersionMismatchError,
    lmdb.IncompatibleError,
    lmdb.PanicError,
    lmdb.BadTxnError,
    lmdb.BadDbiError,
)


def damaged(data: Path, why: str) -> StoreDamaged:
    """The one line that refuses a damaged store file, wherever it is found."""
    return StoreDamaged(f"{data}: the store file is damaged ({why}); {damaged_hint(data)}")


def check_file_length(path: Path, *, strict: bool = False) -> int:
    """Refuse a data.mdb shorter than the pages its newer meta page says it has: mapped, the
    first read past its end is a SIGBUS that kills the process (a copy or restore cut short, a
    sync tool, a disk full during a backup). Bytes that are no LMDB file are left to LMDB's open,
    which refuses them with MDB_INVALID, unless `strict` (a file that was open and valid before).
    Returns the length the header needs (0: nothing to check). Plain reads of two meta pages: a
    few hundred bytes."""
    data = path / "data.mdb"
    try:
        with open(data, "rb") as f:
            first = read_meta_page(f, 0)
            second = read_meta_page(f, first.page_size) if first else None
            # the length after the metas: a writer grows the file before it writes the meta page
            # that counts the new pages, so a commit in between never looks like a short file
            size = os.fstat(f.fileno()).st_size
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        if strict:
            raise damaged(data, "the file is gone from its directory") from None
        return 0  # nothing to map yet, or no file: LMDB's open says so
    except OSError as e:
        raise StoreError(
            f"{data}: cannot read the store file: {e.strerror or e}", errno=e.errno
        ) from None
    if strict and (first is None or second is None):
        raise damaged(data, "its header holds no valid LMDB meta pages")
    if first is None or size == 0:  # empty: a new file LMDB initialises (read-only: refuses)
        return 0
    if second is None:
        if size >= 2 * first.page_size:
            return 0  # the second page is no meta page: LMDB refuses the file as invalid
        meta = first._replace(last_pg=max(first.last_pg, 1))
    else:
        meta = max(first, second, key=lambda m: m.txnid)  # the one LMDB opens
    need = (meta.last_pg + 1) * meta.page_size
    if size < need:
        raise StoreDamaged(
            f"{data}: the store file is damaged (truncated): {size} bytes where its LMDB header "
            f"says {need} ({meta.last_pg + 1} pages of {meta.page_size}); {damaged_hint(data)}"
        )
    return need


def open_env(path: Path, *, readonly: bool, map_size: int, max_readers: int) -> lmdb.Environment:
    key = str(path.resolve())
    held = ENVS.get(key)
    if held is not None:
        if held.readonly and not readonly:
            raise StoreError(f"{path}: already open read-only in this process; close it first")
        held.refs += 1
        return held.env
    need = check_file_length(path)  # before the map: a short file would be a SIGBUS, not an error
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
        mode=0o600,  # data.mdb and lock.mdb owner-only, whatever the umask (callers make the dir)
    )
    try:
        fd = os.open(path / "data.mdb", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        env.close()
        data = path / "data.mdb"
        raise StoreError(f"{data}: cannot open: {e.strerror or e}", errno=e.errno) from None
    ENVS[key] = HeldEnv(env, 1, readonly, Gate(), fd, need)
    return env


def close_env(path: Path) -> None:
    key = str(path.resolve())
    held = ENVS.get(key)
    if held is None:
        return
    held.refs -= 1
    if held.refs <= 0:
        del ENVS[key]
        held.env.close()
        os.close(held.data_fd)


def space_hint(path: Path) -> str:
    """LMDB reports a short write (disk full, a file size limit) as a bare EIO: name the
    likely causes, with the figures to check them, and what makes room."""
    try:
        free = shutil.disk_usage(path).free
        soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    except (OSError, ValueError):
        return ""
    limit = "" if soft == resource.RLIM_INFINITY else f", file size limit {soft} bytes"
    return (
        f" (disk full or a file size limit? {free // 2**20} MiB free there{limit}; free space "
        "there, or `kvstore evict` entries: the next write reuses their pages)"
    )


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
