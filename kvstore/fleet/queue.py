"""Write-behind upload to the fleet tier: a persistent queue in its own LMDB environment
(HOME/remote-queue, beside the store, so the store's format is untouched) and the worker thread
that drains it.

A local commit adds its key (Store.on_commit; the daemon's put_blocks for learned block records);
the worker uploads it later, so a put never waits on the remote. Entries and records queue in
tables of their own (`kind`). The queue survives restarts; what the store holds but the queue
never saw (a CLI warm without a daemon, an import, records stored before [remote] was set) is
found by `sweep`. The same environment keeps the measured transfer rates the warm's cost rule
reads.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import msgpack

from kvstore.degrade import daemon_handler
from kvstore.errors import KVStoreError, RemoteError, StoreError, counted
from kvstore.fleet.learned import upload_record
from kvstore.fleet.objects import Remote
from kvstore.fleet.sightings import Sightings
from kvstore.learned.blockstore import BlockStore
from kvstore.store.entry import EntryMeta
from kvstore.store.lmdbenv import close_env, gate_of, open_env
from kvstore.store.store import Store

log = logging.getLogger("kvstore")

QUEUE_DIR = "remote-queue"
IDLE_SECONDS = 5.0  # how often an idle worker re-checks the queue without being woken
RATE_WEIGHT = 0.5  # weight of the newest measurement in a rate's moving average


class UploadQueue:
    """Keys waiting for upload (`queue`), keys the remote has (`done`), measured rates (`rates`);
    learned records' keys in `rqueue` and `rdone`."""

    def __init__(self, home: Path):
        self.path = Path(home) / QUEUE_DIR
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            self.env = open_env(self.path, readonly=False, map_size=8 * 2**20, max_readers=126)
        except lmdb.Error as e:
            raise StoreError(f"{self.path}: cannot open the upload queue: {e}") from None
        self._gate = gate_of(self.path)
        self._rates = self.env.open_db(b"rates")
        self._tables = {
            "entry": (self.env.open_db(b"queue"), self.env.open_db(b"done")),
            "record": (self.env.open_db(b"rqueue"), self.env.open_db(b"rdone")),
        }

    def close(self) -> None:
        if self.env is not None:
            close_env(self.path)
            self.env = None

    def __enter__(self) -> UploadQueue:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _write(self, fn: Callable[[lmdb.Transaction], Any]) -> Any:
        with self._gate.exclusive():
            while True:
                try:
                    with self.env.begin(write=True) as txn:
                        return fn(txn)
                except lmdb.MapFullError:
                    self.env.set_mapsize(self.env.info()["map_size"] * 2)
                except lmdb.Error as e:
                    raise StoreError(f"{self.path}: upload queue write failed: {e}") from None

    def _read(self, fn: Callable[[lmdb.Transaction], Any]) -> Any:
        for _ in range(3):
            try:
                with self._gate.txn(), self.env.begin() as txn:
                    return fn(txn)
            except lmdb.MapResizedError:
                with self._gate.exclusive():
                    self.env.set_mapsize(0)
        raise StoreError(f"{self.path}: the upload queue keeps being resized under this reader")

    # -- the queue ----------------------------------------------------------------------------

    def add(self, keys: list[bytes], kind: str = "entry") -> int:
        """Queue keys the remote is not known to have; returns how many were queued."""
        record = msgpack.packb({"queued": time.time(), "tries": 0, "error": None})
        queue, done = self._tables[kind]

        def fn(txn):
            n = 0
            for k in keys:
                if txn.get(k, db=done) is None:
                    n += txn.put(k, record, db=queue, overwrite=False)
            return n

        return self._write(fn)

    def pending(self, kind: str = "entry") -> list[bytes]:
        return self._keys(self._tables[kind][0])

    def done(self, key: bytes, outcome: str, kind: str = "entry") -> None:
        queue, done = self._tables[kind]

        def fn(txn):
            txn.delete(key, db=queue)
            txn.put(key, msgpack.packb({"at": time.time(), "outcome": outcome}), db=done)

        self._write(fn)

    def drop(self, key: bytes, kind: str = "entry") -> None:
        """A queued key the store no longer holds (evicted before it went up)."""
        self._write(lambda txn: txn.delete(key, db=self._tables[kind][0]))

    def failed(self, key: bytes, error: str, kind: str = "entry") -> None:
        queue = self._tables[kind][0]

        def fn(txn):
            raw = txn.get(key, db=queue)
            rec = msgpack.unpackb(raw) if raw is not None else {"queued": time.time(), "tries": 0}
            rec.update(tries=rec.get("tries", 0) + 1, error=error)
            txn.put(key, msgpack.packb(rec), db=queue)

        self._write(fn)

    def forget(self, keys: list[bytes]) -> None:
        """The remote no longer has these (gc deleted them): a box holding one uploads it again."""
        dones = [done for _, done in self._tables.values()]
        self._write(lambda txn: [txn.delete(k, db=d) for k in keys for d in dones])

    def sweep(self, store: Store, blocks: BlockStore | None = None) -> int:
        """Queue every stored entry and learned record neither queued nor known uploaded.
        `blocks`: the store's records, opened on the thread that writes it (opening their tables
        from another thread takes LMDB's write lock outside the store's gate)."""
        blocks = blocks if blocks is not None else BlockStore(store)
        n = 0
        # records fetched from the fleet (a pull, a request's read-through) are there already
        records = [m.key for m in blocks.records() if m.extra.origin != "remote"]
        for kind, keys in (("entry", store.keys()), ("record", records)):
            known = set(self.pending(kind)) | set(self._keys(self._tables[kind][1]))
            n += self.add([k for k in keys if k not in known], kind)
        return n

    def _keys(self, table: Any) -> list[bytes]:
        return self._read(lambda txn: [bytes(k) for k in txn.cursor(table).iternext(values=False)])

    def counts(self) -> dict[str, int]:
        def fn(txn):
            (q, d), (rq, rd) = self._tables["entry"], self._tables["record"]
            return {
                "queued": txn.stat(q)["entries"],
                "uploaded": txn.stat(d)["entries"],
                "records_queued": txn.stat(rq)["entries"],
                "records_uploaded": txn.stat(rd)["entries"],
            }

        return self._read(fn)

    # -- refusals ------------------------------------------------------------------------------

    def refused(self, e: RemoteError) -> None:
        """Count an object refused for its cause (the same counter on the metrics port)."""
        self.count_refusal(e.cause)

    def count_refusal(self, cause: str) -> None:
        """Count an object refused: "unauthentic", "corrupt", "mismatch" (the semantic check)."""
        from kvstore import metrics

        metrics.FLEET_REFUSED.labels(reason=cause).inc()
        name = f"refused:{cause}".encode()

        def fn(txn):
            raw = txn.get(name, db=self._rates)
            txn.put(name, msgpack.packb(1 + (0 if raw is None else int(msgpack.unpackb(raw)))),
                    db=self._rates)  # fmt: skip

        self._write(fn)

    def refusals(self) -> dict[str, int]:
        """Objects refused so far, by cause ("unauthentic", "corrupt", ...)."""
        return {cause: int(n) for cause, n in self._named("refused:").items()}

    def _named(self, prefix: str) -> dict[str, Any]:
        """{name: value} of the `rates` rows named `prefix` + name."""
        tag = prefix.encode()

        def fn(txn):
            with txn.cursor(db=self._rates) as cur:
                return {bytes(k)[len(tag) :].decode(): msgpack.unpackb(v)
                        for k, v in cur if bytes(k).startswith(tag)}  # fmt: skip

        return self._read(fn)

    # -- quarantine (kvstore.fleet.check) ------------------------------------------------------

    def quarantine(self, box: str, reason: str) -> None:
        """No object `box` uploaded is used here until `release(box)`."""
        name = f"quarantine:{box}".encode()
        self._write(lambda txn: txn.put(name, msgpack.packb(reason), db=self._rates))

    def release(self, box: str) -> bool:
        """Lift `box`'s quarantine; False when it was not quarantined."""
        name = f"quarantine:{box}".encode()
        return bool(self._write(lambda txn: txn.delete(name, db=self._rates)))

    def quarantined(self) -> dict[str, str]:
        """Quarantined uploaders (box id -> why)."""
        return self._named("quarantine:")

    # -- measured rates -----------------------------------------------------------------------

    def rate(self, name: str) -> float | None:
        raw = self._read(lambda txn: txn.get(name.encode(), db=self._rates))
        return None if raw is None else float(msgpack.unpackb(raw))

    def measured(self, name: str, value: float) -> None:
        """Fold one measurement (bytes/s, tokens/s) into the named moving average."""
        if value <= 0:
            return
        old = self.rate(name)
        new = value if old is None else RATE_WEIGHT * value + (1 - RATE_WEIGHT) * old
        self._write(lambda txn: txn.put(name.encode(), msgpack.packb(new), db=self._rates))


def upload_one(remote: Remote, store: Store, queue: UploadQueue, key: bytes) -> str:
    """Upload one queued entry: "uploaded", "exists" or "gone" (no longer stored here). A
    RemoteError leaves it queued; a locally corrupt entry is dropped, never uploaded."""
    meta = store.get_meta(key)
    if meta is None:
        queue.drop(key)
        return "gone"
    if not store.blob_ok(meta):
        queue.drop(key)
        log.error("remote: entry %s is corrupt locally; not uploaded (kvstore verify)", key.hex())
        return "gone"
    t = time.monotonic()
    outcome = remote.upload(meta, lambda offset, size: store.read_blob_range(key, offset, size))
    if outcome == "uploaded":
        queue.measured("upload_bps", meta.nbytes / max(time.monotonic() - t, 1e-6))
    queue.done(key, outcome)
    return outcome


def upload_one_record(remote: Remote, blocks: BlockStore, queue: UploadQueue, key: bytes) -> str:
    """Upload one queued learned record, as `upload_one` an entry: "uploaded", "exists" or
    "gone" (evicted, corrupt or cut off from its chain here: dropped from the queue). A
    RemoteError leaves it queued."""
    say = lambda text: log.warning("remote: %s", text)  # noqa: E731
    outcome = upload_record(remote, blocks, key, blocks.cut_at(), say)
    if outcome == "gone":
        queue.drop(key, "record")
    else:
        queue.done(key, outcome, "record")
    return outcome


def reseal(remote: Remote, store: Store, *, say: Callable[[str], None]) -> dict[str, int]:
    """After a key rotation: re-upload, sealed under the current fleet_key, every object on the
    remote that this box uploaded, that is still sealed under fleet_key_previous, and that this
    box still holds. Whose an object is, is read from its signed provenance (every object this
    box holds is fetched and verified), never from its S3 metadata: a copy that dropped the
    metadata is still this box's. Other boxes' objects are theirs to re-seal: each box runs it.
    Counts: resealed, current (already under the current key), other (another box's; for an
    object not held here, as its unsigned metadata says), gone (not held here), refused."""
    from kvstore.fleet.objects import verify_object, verify_record

    rs = remote.settings
    if len(rs.fleet_keys) < 2:
        raise KVStoreError(
            "the credentials file has no fleet_key_previous: nothing is sealed under an old key "
            "(`kvstore remote key new` rotates the key and keeps the old one as previous)"
        )
    counts = {"resealed": 0, "current": 0, "other": 0, "gone": 0, "refused": 0}
    blocks = BlockStore(store)
    entries = set(store.keys())
    records = {m.key for m in blocks.records()}
    listed = [(o, False) for o in remote.objects()] + [(o, True) for o in remote.records()]
    for o, record in listed:
        if o.key not in (records if record else entries):  # nothing here to re-seal it from
            counts["gone" if remote.uploader(o.name) == rs.box_id else "other"] += 1
            continue
        data, _ = remote.fetch(o.key, name=o.name)
        try:
            if record:
                prov = verify_record(o.key, data, keys=rs.fleet_keys).provenance
            else:
                prov = verify_object(o.key, data, keys=rs.fleet_keys)[2]
        except RemoteError as e:
            say(f"warning: {e}; not re-sealed")
            counts["refused"] += 1
            continue
        if prov.box != rs.box_id:
            counts["other"] += 1
            continue
        if not prov.previous:
            counts["current"] += 1
            continue
        if record:
            outcome = upload_record(remote, blocks, o.key, blocks.cut_at(), say, replace=True)
        else:
            meta = store.get_meta(o.key)
            if meta is None or not store.blob_ok(meta):
                counts["gone"] += 1
                continue
            read = functools.partial(store.read_blob_range, o.key)  # (offset, size) -> bytes
            outcome = remote.upload(meta, read, replace=True)
        counts["resealed" if outcome == "uploaded" else "gone"] += 1
    return counts


class Uploader(threading.Thread):
    """Drains the queue on a side thread (boto3 only: no mlx work here); stops between entries.
    `sightings`: the bucket's seen-markers this box writes and reads (fleet-wide learning)."""

    def __init__(self, remote: Remote, store: Store, queue: UploadQueue):
        super().__init__(name="kvstore-upload", daemon=True)
        self.remote, self.store, self.queue = remote, store, queue
        self.blocks = BlockStore(store)  # its tables opened here, on the store's writing thread
        self.sightings = Sightings(remote)
        self.retry_interval = remote.settings.retry_interval
        self._stop_event = threading.Event()
        self._wake = threading.Event()
        self._cause: str | None = None  # the failure last logged: one line per cause, not per try

    def notify(self, meta: EntryMeta | None = None) -> None:
        """Store.on_commit hook: queue the key (one small local write) and wake the worker."""
        self._queue_keys([meta.key] if meta is not None else [], "entry")

    def notify_records(self, keys: list[bytes]) -> None:
        """Learned records committed (the daemon's put_blocks): queue them and wake the worker."""
        self._queue_keys(keys, "record")

    def _queue_keys(self, keys: list[bytes], kind: str) -> None:
        try:
            self.queue.add(keys, kind)
        except KVStoreError as e:  # the local put committed; the sweep at next start catches up
            log.error("remote: %s", e)
        self._wake.set()

    def stop(self, timeout: float = 2.0) -> bool:
        self.sightings.stop(timeout)
        self._stop_event.set()
        self._wake.set()
        if self.is_alive():
            self.join(timeout)
        return not self.is_alive()

    def run(self) -> None:
        try:
            if n := self.queue.sweep(self.store, self.blocks):
                log.info("remote: queued %s not yet uploaded",
                         counted(n, "stored entry or learned record"))  # fmt: skip
        except KVStoreError as e:
            log.error("remote: sweep failed: %s", e)
        while not self._stop_event.is_set():
            self._wake.clear()
            with daemon_handler("remote: uploader failed; retrying") as failed:  # never silently
                drained = self._drain_or_pause()
            if failed.error is not None or not drained:
                self._stop_event.wait(self.retry_interval)
                continue
            self._wake.wait(IDLE_SECONDS)

    def _drain_or_pause(self) -> bool:
        """Upload what is queued: True, or False when the remote failed (said once a cause)."""
        try:
            self._drain()
        except RemoteError as e:
            if e.cause != self._cause:
                log.error(
                    "remote: upload paused: %s; %d entr(ies) kept in the queue, retrying "
                    "every %gs", e, len(self.queue.pending()), self.retry_interval,
                )  # fmt: skip
                self._cause = e.cause
            return False
        return True

    def _drain(self) -> None:
        kinds: tuple[tuple[str, Callable[..., str], Any], ...] = (
            ("entry", upload_one, self.store),
            ("record", upload_one_record, self.blocks),
        )
        for kind, upload, where in kinds:
            for key in self.queue.pending(kind):
                if self._stop_event.is_set():
                    return
                try:
                    outcome = upload(self.remote, where, self.queue, key)
                except RemoteError as e:
                    self.queue.failed(key, str(e), kind)
                    raise
                if self._cause is not None:
                    log.info("remote: reachable again; uploading the queue")
                    self._cause = None
                if outcome != "gone":
                    what = "entry" if kind == "entry" else "learned record"
                    log.info("remote: %s %s %s", what, key.hex(), outcome)


def start_uploader(remote: Remote, store: Store, home: Path) -> Uploader:
    """Open the queue, hook it to the store's commits and start the worker (the daemon)."""
    queue = UploadQueue(home)
    worker = Uploader(remote, store, queue)
    store.on_commit.append(worker.notify)
    worker.start()
    return worker


def enqueue_on_commit(store: Store, home: Path) -> UploadQueue:
    """Without a daemon (a CLI warm): commits are queued for the next daemon or `remote push`."""
    queue = UploadQueue(home)

    def add(meta) -> None:
        try:
            queue.add([meta.key])
        except KVStoreError as e:
            log.error("remote: %s", e)

    store.on_commit.append(add)
    return queue
