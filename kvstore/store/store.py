"""The LMDB store: entry meta (msgpack) and blobs (safetensors bytes) under 32-byte keys.

One writer (the daemon, or the CLI when no daemon runs) and many readers. Every write goes through
`write`, the one place that grows the map; every read through `read`; both recover from
MapResizedError (another process grew the map) by adopting its size. They are the public
transaction API the store's other tables (kvstore.learned.blockstore) and readers use. Blob bytes
read through `buffers=True` are checksummed and decoded (copied into mlx memory) inside their
transaction. The meta record and keys live in `kvstore.store.entry`, the process-wide environment
and its gate in `kvstore.store.lmdbenv`. The codec (and so mlx) is imported only by the methods
that encode or decode, so listing, stats and eviction never load mlx.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import lmdb

from kvstore import tokens as tk
from kvstore.codec import CODEC_VERSION
from kvstore.errors import (
    DISK_FULL_ERRNOS,
    ChecksumError,
    CodecError,
    CorruptEntryError,
    StoreDamaged,
    StoreError,
)
from kvstore.home.settings import DEFAULT, STORE_DIR, store_dir_problem
from kvstore.store.entry import (
    _META_FIELDS,
    CHUNK_SUMS_KEY,
    KEY_BYTES,
    EntryExtra,
    EntryMeta,
    blob_checksum,
    checksums,
    tokens_match_key,
)
from kvstore.store.keys import fingerprint_of
from kvstore.store.lmdbenv import (
    DAMAGE,
    check_file_length,
    close_env,
    damaged,
    damaged_hint,
    held_env,
    lmdb_errno,
    open_env,
    space_hint,
)

# A write failing with one of these may succeed once the pages the last commit freed are usable.
SPACE_ERRNOS = frozenset({*DISK_FULL_ERRNOS, errno.EIO})  # LMDB says EIO for a short write
AGED_KEY = b"kvstore:aged"  # in LMDB's main table: a stamp whose commit ages freed pages


class Store:
    """One LMDB environment in `home/store`: reads, writes, check and stats, each in one
    transaction of `_read` or `_write`. Not to be carried across fork().

    A file found damaged while open (LMDB meets pages that are no pages, a header of garbage, the
    file truncated under the map) raises StoreDamaged, the one line a fresh open would say; from
    then on every transaction raises it again without touching the map, and the `on_damage`
    hooks are called once (the daemon stops on it)."""

    def __init__(
        self,
        home: str | Path,
        *,
        readonly: bool = False,
        map_size: int = DEFAULT.map_size,
        max_map_size: int = DEFAULT.max_map_size,
        max_readers: int = 256,
    ):
        self.path = Path(home) / STORE_DIR
        self.readonly = readonly
        self.max_map_size = max_map_size
        self._pid = os.getpid()
        self.damage: StoreDamaged | None = None  # set once this store found its file damaged
        # called once, on the thread that found the damage (the daemon stops on it)
        self.on_damage: list[Callable[[StoreDamaged], None]] = []
        self._damage_lock = threading.Lock()
        if problem := store_dir_problem(self.path):
            raise StoreError(problem)
        if readonly and not (self.path / "data.mdb").is_file():
            raise StoreError(f"{self.path}: no store here (run `kvstore warm` or start the daemon)")
        if readonly and (self.path / "data.mdb").stat().st_size == 0:  # a writer would make one
            data = self.path / "data.mdb"
            raise StoreError(f"{data}: the store file is empty (0 bytes); {damaged_hint(data)}")
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
            self._held = held_env(self.path)
            self._gate = self._held.gate
            self._meta, self._blob = self._open_dbs(create=not readonly)
        except DAMAGE as e:
            raise StoreDamaged(  # bytes that are no LMDB store of this version: a damaged file
                f"{self.path}: cannot open the LMDB store: {e}; "
                f"{damaged_hint(self.path / 'data.mdb')}",
                errno=lmdb_errno(e),
            ) from None
        except lmdb.Error as e:
            raise StoreError(
                f"{self.path}: cannot open the LMDB store: {e}", errno=lmdb_errno(e)
            ) from None
        if not readonly:
            self.env.reader_check()
        self.on_commit: list[Callable[[EntryMeta], None]] = []  # after each put (the fleet queue)

    def _open_dbs(self, *, create: bool) -> tuple[Any, Any]:
        """The two databases' handles. Opening them is a transaction: after another process
        grew the map (since this process opened the environment, or between that open and
        this), it meets MapResizedError, and the new size is adopted as `_read` adopts it."""
        for _ in range(3):
            try:
                meta = self.env.open_db(b"meta", create=create)
                return meta, self.env.open_db(b"blob", create=create)
            except lmdb.MapResizedError:
                self._adopt_grown_map()
        raise StoreError(f"{self.path}: the map keeps being resized under this open")

    def _adopt_grown_map(self) -> None:
        """Take the size another process grew the map to, with this process's readers held off
        (LMDB's set_mapsize needs no other transaction of this process open)."""
        with self._gate.exclusive():
            self._set_mapsize(0)

    def _set_mapsize(self, size: int) -> None:
        """LMDB's set_mapsize (0: the size the file's header says). A failure is StoreDamaged
        where the header is no longer a valid one (garbage that reads as a huge map), else a
        StoreError; py-lmdb has dropped the environment's table handles either way."""
        try:
            self.env.set_mapsize(size)
        except lmdb.Error as e:
            try:
                check_file_length(self.path, strict=True)
            except StoreDamaged as bad:
                raise self._damaged(bad) from None
            raise StoreError(f"{self.path}: cannot map the store: {e}") from None

    def _damaged(self, e: Exception | str) -> StoreDamaged:
        """The StoreDamaged this store raises from now on, for what showed the damage: an LMDB
        error (DAMAGE), the line a check made, or why the file is short."""
        with self._damage_lock:
            first = self.damage is None
            if first:
                if isinstance(e, StoreDamaged):
                    self.damage = e
                else:
                    why = e if isinstance(e, str) else f"LMDB cannot read its pages: {e}"
                    self.damage = damaged(self.path / "data.mdb", why)
        assert self.damage is not None
        if first:
            for hook in self.on_damage:
                hook(self.damage)
        return self.damage

    def _check_file(self) -> None:
        """Before a transaction: the damage found before, or a file truncated under the map
        (found here, by length, rather than as a SIGBUS on the first page past its end)."""
        if self.damage is not None:
            raise self.damage
        if why := self._held.short():
            raise self._damaged(why)

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

    def write(self, fn: Callable[[lmdb.Transaction], Any]) -> Any:
        """The one write path: `fn(txn)` in a write transaction, its result returned; retried
        (`fn` runs again) after doubling the map when it is full or adopting the size another
        process grew it to. StoreError on a read-only store or a failed write."""
        self._check_pid()
        if self.readonly:
            raise StoreError(f"{self.path}: opened read-only")
        with self._gate.exclusive():
            self._check_file()
            result = self._write_locked(fn)
            self._held.grown()
            return result

    def _write_locked(self, fn: Callable[[lmdb.Transaction], Any]) -> Any:
        adopted = 0
        aged = False
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
                self._set_mapsize(0)
            except lmdb.MapFullError:
                size = self.env.info()["map_size"]
                if size * 2 > self.max_map_size:
                    raise StoreError(
                        f"{self.path}: store map is full at {size} bytes and the cap "
                        f"max_map_size={self.max_map_size} is reached; evict entries or raise it"
                    ) from None
                self._set_mapsize(size * 2)  # no transaction of this process is open
            except DAMAGE as e:  # before the next: a damaged file is not a full disk
                raise self._damaged(e) from None
            except lmdb.Error as e:  # ENOSPC and EIO come from put or commit: keep the errno
                if not aged and lmdb_errno(e) in SPACE_ERRNOS and self._age_freed_pages():
                    aged = True  # retried once: the pages an evict just freed may serve it
                    continue
                raise StoreError(
                    f"{self.path}: write failed: {e}{space_hint(self.path)}", errno=lmdb_errno(e)
                ) from None
            except OSError as e:
                raise StoreError(
                    f"{self.path}: write failed: {e}{space_hint(self.path)}", errno=e.errno
                ) from None

    def _age_freed_pages(self) -> bool:
        """After a write failed for space: one small commit, so that the pages the last commit
        freed (an evict) serve the retry. LMDB gives a write only the pages freed before the
        last commit (mdb_find_oldest starts from the writer's txnid - 1), so the first write
        after an evict would grow the file instead, on a disk that is full. False when this
        commit fails too (no room even for it)."""
        try:
            with self.env.begin(write=True) as txn:  # the main table, beside the tables' names
                txn.put(AGED_KEY, int(time.time() * 1e6).to_bytes(8, "big"))
        except lmdb.Error:
            return False
        return True

    def read(self, fn: Callable[[lmdb.Transaction], Any], *, buffers: bool = False) -> Any:
        """`fn(txn)` in a short read transaction, its result returned (`reading`, as a call)."""
        with self.reading(buffers=buffers) as txn:
            return fn(txn)

    @contextlib.contextmanager
    def reading(self, *, buffers: bool = False) -> Iterator[lmdb.Transaction]:
        """A short read transaction: `with store.reading() as txn: ...` (with `buffers`, values
        are memoryviews valid only inside the block). A map another process grew meanwhile is
        adopted before the transaction begins (LMDB says so at its start)."""
        self._check_pid()
        for _ in range(3):
            with contextlib.ExitStack() as opening:  # closes what was opened if a begin fails
                held = opening.enter_context(contextlib.ExitStack())
                try:
                    held.enter_context(self._gate.txn())
                    self._check_file()
                    txn = held.enter_context(self.env.begin(buffers=buffers))
                except (lmdb.MapResizedError, lmdb.ReadersFullError) as e:
                    failed: Exception | None = e
                except DAMAGE as e:
                    raise self._damaged(e) from None
                else:
                    failed = None
                    opening.pop_all()
            if isinstance(failed, lmdb.MapResizedError):
                self._adopt_grown_map()
                continue
            if failed is not None:
                # Every slot is held, often by readers that died: reader_check() (the daemon
                # runs it periodically) frees those. Say so instead of a bare lmdb error.
                raise StoreError(
                    f"{self.path}: all LMDB reader slots are in use "
                    f"({self.env.max_readers()} max_readers); dead readers are cleared by the "
                    "daemon's periodic reader_check, or close some readers"
                ) from None
            with held:
                try:
                    yield txn
                except DAMAGE as e:
                    raise self._damaged(e) from None
            return
        raise StoreError(f"{self.path}: the map keeps being resized under this reader")

    _read, _write = read, write  # the names this module's own methods use

    def entry_count(self) -> int:
        """Entries in the store, all models (O(1): the table's own count)."""
        return int(self.read(lambda txn: txn.stat(self._meta)["entries"]))

    def reader_check(self) -> int:
        return self.env.reader_check()

    # -- reads ---------------------------------------------------------------------------
    def _scan(self, txn, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        cur = txn.cursor(self._meta)
        if not cur.set_range(prefix):
            return
        for k, v in cur:
            k = bytes(k)
            if not k.startswith(prefix):
                break
            yield k, bytes(v)

    def metas(self, fingerprint: bytes = b"", *, errors: list | None = None) -> list[EntryMeta]:
        """Every entry's meta (one model's with `fingerprint`): one range scan, short transaction.

        Unreadable metas are appended to `errors` (as CorruptEntryError) if given, else raised.
        """
        raw = self._read(lambda txn: list(self._scan(txn, fingerprint)))
        out = []
        for k, v in raw:
            try:
                out.append(EntryMeta.unpack(k, v))
            except CorruptEntryError as e:
                if errors is None:
                    raise
                errors.append(e)
        return out

    def keys(self) -> list[bytes]:
        return self._read(
            lambda txn: [bytes(k) for k in txn.cursor(self._meta).iternext(values=False)]
        )

    def get_meta(self, key: bytes) -> EntryMeta | None:
        raw = self._read(lambda txn: txn.get(key, db=self._meta))
        return None if raw is None else EntryMeta.unpack(key, bytes(raw))

    def load(self, key: bytes, tokens: bytes | None = None) -> tuple[EntryMeta, list]:
        """Meta and decoded cache of one entry; `tokens` (packed), if given, must match. A
        state-only snapshot (extra.kv_layers) comes with those layers empty: serve it through
        `kvstore.learned.blockstore.load_entry`, which puts them back from the block records."""

        def fn(txn):
            raw = txn.get(key, db=self._meta)
            if raw is None:
                raise KeyError(key.hex())
            meta = EntryMeta.unpack(key, bytes(raw))
            if tokens is not None and meta.tokens != tokens:
                raise KeyError(key.hex())  # a hash collision: another prefix lives under this key
            blob = txn.get(key, db=self._blob)
            return meta, self._decode(key, meta, blob)

        return self._read(fn, buffers=True)

    def blob_ok(self, meta: EntryMeta) -> bool:
        """The stored blob has its meta's length and checksum (no decode: a hash of the bytes)."""

        def fn(txn):
            blob = txn.get(meta.key, db=self._blob)
            return (
                blob is not None
                and len(blob) == meta.nbytes
                and (blob_checksum(blob) == meta.checksum)
            )

        return self._read(fn, buffers=True)

    def read_blob(self, key: bytes) -> bytes:
        blob = self._read(lambda txn: txn.get(key, db=self._blob))
        if blob is None:
            raise KeyError(key.hex())
        return bytes(blob)

    def read_blob_range(self, key: bytes, offset: int, size: int) -> bytes:
        """`size` bytes of a blob from `offset`, in one short read transaction (a multipart
        upload reads each part on its own rather than holding one open for the whole upload)."""

        def fn(txn):
            blob = txn.get(key, db=self._blob)
            return None if blob is None else bytes(blob[offset : offset + size])

        part = self._read(fn, buffers=True)
        if part is None:
            raise KeyError(key.hex())
        return part

    @staticmethod
    def _decode(key: bytes, meta: EntryMeta, blob) -> list:
        if blob is None:
            raise CorruptEntryError(key, "meta without blob")
        if len(blob) != meta.nbytes:
            raise CorruptEntryError(key, f"blob is {len(blob)} bytes, meta says {meta.nbytes}")
        from kvstore.codec import codec  # mlx: only where an entry is decoded

        try:  # the checksum runs alongside the copy of a large blob, before anything is returned
            cache, _ = codec.decode(
                blob, name=f"entry {key.hex()}", checksum=meta.checksum, chunk_sums=meta.chunk_sums
            )
        except ChecksumError:
            raise CorruptEntryError(key, "blob checksum mismatch") from None
        except CodecError as e:
            raise CorruptEntryError(key, str(e)) from None
        layers = set(meta.extra.kv_layers or ())  # a state-only snapshot's empty KV
        rest = [c for i, c in enumerate(cache) if i not in layers] if layers else cache
        held = codec.cache_tokens(rest)
        if held != meta.ntokens and not (held is None and codec.keeps_no_offset(rest)):
            raise CorruptEntryError(
                key, f"its KV holds {held} tokens but the entry is {meta.ntokens} tokens"
            )
        return cache

    # -- writes --------------------------------------------------------------------------
    def put(self, key: bytes, blob: bytes, **fields: Any) -> EntryMeta:
        """Store one entry; the same key and blob again keeps `created` and hits. The fields are
        stored as given: the put operation (kvstore.ops.put) checks them and records where the
        model resolved, in the putting process's cwd and environment, before they come here."""
        if len(key) != KEY_BYTES:
            raise StoreError(f"key must be {KEY_BYTES} bytes, got {len(key)}")
        now = time.time()
        checksum, chunk_sums = checksums(blob)
        extra = fields.pop("extra", None)
        if extra is None or isinstance(extra, (dict, EntryExtra)):  # chunk sums: computed here
            extra = EntryExtra.of(extra).without(CHUNK_SUMS_KEY)
            extra = extra if chunk_sums is None else extra.updated(chunk_sums=chunk_sums)
        unknown = set(fields) - set(_META_FIELDS)
        if unknown:
            raise StoreError(f"unknown meta field(s): {sorted(unknown)}")

        tokens = fields.get("tokens")
        if not isinstance(tokens, bytes) or len(tokens) % tk.SIZE:
            raise StoreError("field 'tokens' must be packed uint32 token ids (bytes)")
        if not tokens_match_key(key, tokens):  # every read would refuse it as corrupt
            raise StoreError(f"entry {key.hex()}: key does not match the entry's tokens")
        draft = EntryMeta(
            key=key,
            tokens=tokens,
            ntokens=tk.count(tokens),
            label=fields.get("label", ""),
            pinned=fields.get("pinned", False),
            model=fields.get("model", ""),
            fingerprint=fingerprint_of(key),
            template_hash=fields.get("template_hash") or b"",
            created=now,
            last_used=now,
            hits=0,
            nbytes=len(blob),
            checksum=checksum,
            codec=fields.get("codec", CODEC_VERSION),
            classes=list(fields.get("classes", [])),
            extra=extra,
        )
        if problem := draft.type_error():
            raise StoreError(f"entry {key.hex()}: {problem}")

        def fn(txn):
            old_raw = txn.get(key, db=self._meta)
            old = None
            if old_raw is not None:
                try:
                    old = EntryMeta.unpack(key, old_raw)
                except CorruptEntryError:
                    old = None
            same = (
                old
                if old is not None and old.checksum == checksum and old.tokens == tokens
                else None
            )
            meta = replace(
                draft,
                pinned=draft.pinned or bool(same and same.pinned),
                created=same.created if same else now,
                hits=same.hits if same else 0,
            )
            txn.put(key, blob, db=self._blob)
            txn.put(key, meta.pack(), db=self._meta)
            return meta

        meta = self._write(fn)
        for notify in self.on_commit:  # after the commit: a failing hook cannot undo it
            notify(meta)
        return meta

    def delete(self, keys: Iterable[bytes]) -> int:
        keys = list(keys)

        def fn(txn):
            n = 0
            for k in keys:
                n += bool(txn.delete(k, db=self._meta))
                txn.delete(k, db=self._blob)
            return n

        return self._write(fn)

    def touch(self, keys: Iterable[bytes], *, now: float | None = None) -> int:
        """Record hits: last_used = now, hits += 1."""
        now = now or time.time()

        counts = Counter(keys)  # a key given twice is two hits
        done: dict[bytes, int] = {}

        def hits(key: bytes) -> Callable[[EntryMeta], EntryMeta]:
            def edit(meta: EntryMeta) -> EntryMeta:
                done[key] = counts[key]  # idempotent: a retried transaction calls it again
                return replace(meta, last_used=now, hits=meta.hits + counts[key])

            return edit

        self.edit_meta({k: hits(k) for k in counts})
        return sum(done.values())

    def edit_meta(self, edits: dict[bytes, Callable[[EntryMeta], EntryMeta | None]]) -> int:
        """Rewrite some entries' meta in one transaction (owners: kvstore.pins.ownership). An edit
        gets the stored meta and returns the new one, or None to leave it; missing or unreadable
        entries are skipped. The key, tokens, checksum and size never change here."""

        def fn(txn):
            n = 0
            for k, edit in edits.items():
                raw = txn.get(k, db=self._meta)
                if raw is None:
                    continue
                try:
                    meta = EntryMeta.unpack(k, raw)
                except CorruptEntryError:
                    continue
                new = edit(meta)
                if new is None:
                    continue
                fixed = (new.key, new.tokens, new.checksum, new.nbytes, new.fingerprint)
                if fixed != (meta.key, meta.tokens, meta.checksum, meta.nbytes, meta.fingerprint):
                    raise StoreError(f"entry {k.hex()}: an edit may not change its identity")
                if problem := new.type_error():
                    raise StoreError(f"entry {k.hex()}: {problem}")
                txn.put(k, new.pack(), db=self._meta)
                n += 1
            return n

        return self._write(fn)

    # -- check and stats -----------------------------------------------------------------
    def check(
        self,
        *,
        decode: bool = True,
        progress: Callable[[int, int], None] | None = None,
    ) -> list[CorruptEntryError]:
        """Verify every entry (meta, length, checksum, full decode); kvstore.ops.verify deletes the
        bad ones through the one eviction."""
        problems: list[CorruptEntryError] = []
        meta_keys = set(self.keys())
        blob_keys = set(
            self._read(
                lambda txn: [bytes(k) for k in txn.cursor(self._blob).iternext(values=False)]
            )
        )
        for k in sorted(blob_keys - meta_keys):
            problems.append(CorruptEntryError(k, "blob without meta"))
        keys = sorted(meta_keys)
        for i, k in enumerate(keys):
            try:
                if decode:
                    self.load(k)
                else:
                    meta = self.get_meta(k)
                    if meta is None:  # deleted since keys() (another writer): as load() says
                        raise KeyError(k.hex())
                    blob = self.read_blob(k)
                    if blob_checksum(blob) != meta.checksum:
                        raise CorruptEntryError(k, "blob checksum mismatch")
            except CorruptEntryError as e:
                problems.append(e)
            except KeyError:
                problems.append(CorruptEntryError(k, "meta without blob"))
            if progress:
                progress(i + 1, len(keys))
        return problems

    def stats(self) -> dict[str, Any]:
        errors: list = []
        metas = self.metas(errors=errors)
        self._check_file()  # info and stat read the mapped header
        info, stat = self.env.info(), self.env.stat()
        return {
            "path": str(self.path),
            "entries": len(metas),
            "pinned": sum(m.pinned for m in metas),
            "bytes": sum(m.nbytes for m in metas),
            "pinned_bytes": sum(m.nbytes for m in metas if m.pinned),
            "tokens": sum(m.ntokens for m in metas),
            "models": len({m.fingerprint for m in metas}),
            "unreadable": len(errors),
            "map_size": info["map_size"],
            "file_bytes": (self.path / "data.mdb").stat().st_size,
            "page_size": stat["psize"],
            "readers": info["num_readers"],
        }
