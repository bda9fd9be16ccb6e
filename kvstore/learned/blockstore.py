"""Learned block records: chains of KV slices keyed by the chain hash of the positions they end at.

Records live in their own named DBs of the Store's environment, so entry scans (`metas`, `ls`,
hydrate) never see them and old readers ignore them:
  bmeta  fingerprint + H(end)            -> sealed msgpack BlockMeta (as entry metas are sealed)
  bblob  fingerprint + H(end)            -> the record's codec blob (layers' KV of [start, end))
  kids   fingerprint + H(start) + H(end) -> b""  (walked from H(0) to find a prompt's chain)
  bstat  b"learned_bytes", b"day:YYYY-MM-DD" (bytes written that local day), b"block_tokens"
H(p) is `kvstore.learned.chain.position_hash`. Every write is one transaction through the Store's
`write`; reads are its `reading` transactions and work on a read-only Store. No mlx at import (a
blob header is validated by `kvstore.learned.records.inspect`, imported when a record is put).
"""

from __future__ import annotations

import heapq
import struct
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import lmdb
import msgpack
import xxhash

from kvstore import tokens as tk
from kvstore.degrade import UNREADABLE
from kvstore.errors import CorruptEntryError, StoreError
from kvstore.home.settings import DEFAULT, Settings
from kvstore.learned.chain import chain_hashes, is_cut, packed, position_hash
from kvstore.store.entry import SCHEMA_VERSION, EntryExtra, packed_fields, seal, with_extra
from kvstore.store.keys import (
    FINGERPRINT_BYTES,
    digest_of,
    fingerprint_of,
    kids_links,
    kids_row,
    pack_key,
    parse_kids_row,
)

if TYPE_CHECKING:
    from kvstore.store.store import Store

DB_NAMES = (b"bmeta", b"bblob", b"kids", b"bstat")
LEARNED_BYTES = b"learned_bytes"
BLOCK_TOKENS = b"block_tokens"
_U64 = struct.Struct("<Q")


def today() -> str:
    """The local day the daily write budget counts in."""
    return time.strftime("%Y-%m-%d", time.localtime())


@dataclass
class BlockMeta:
    key: bytes  # fingerprint + H(end)
    start: int
    end: int
    tokens: bytes  # packed uint32: this record's tokens only, [start, end)
    nbytes: int
    checksum: int  # xxh3-64 of the blob
    codec: int
    classes: list[str]
    created: float
    last_used: float
    hits: int
    label: str
    pins: int = 0  # entries that use this record; > 0: never evicted
    extra: EntryExtra = field(default_factory=EntryExtra)  # model, kv_bits ... as the put gave

    def pack(self) -> bytes:
        return seal(packed_fields(self))

    @classmethod
    def unpack(cls, key: bytes, raw: bytes) -> BlockMeta:
        try:
            d = msgpack.unpackb(raw, raw=False)
            if not isinstance(d, dict) or d.get("v") != SCHEMA_VERSION:
                raise ValueError("not a sealed record")
            body = d.get("body")
            if not isinstance(body, bytes) or xxhash.xxh3_64_intdigest(body) != d.get("sum"):
                raise CorruptEntryError(key, "record meta checksum mismatch (it was altered)")
            meta = cls(key=key, **with_extra(msgpack.unpackb(body, raw=False)))
        except CorruptEntryError:
            raise
        except UNREADABLE as e:
            raise CorruptEntryError(
                key, f"unreadable record meta ({type(e).__name__}: {e})"
            ) from None
        if len(meta.tokens) != tk.nbytes(meta.end - meta.start) or not 0 <= meta.start < meta.end:
            raise CorruptEntryError(key, "record meta does not match its token count")
        return meta

    @property
    def ntokens(self) -> int:
        return self.end - self.start


class EvictedRecords(NamedTuple):
    freed: int  # bytes
    records: list[BlockMeta]  # the records evicted, in eviction order
    # of each, the packed tokens from position 0 to its end (b"": its chain was broken):
    # what a tombstone of it names (kvstore.home.tombstones)
    prefixes: list[bytes]


class BlockStore:
    """A view over an open Store: the learned-block tables, read and written through the Store's
    transactions (`Store.read` / `Store.write`)."""

    def __init__(self, store: Store, *, block: int = DEFAULT.block_tokens):
        self.store = store
        self.block = block
        self._dbs: dict[bytes, Any] = {}  # name -> the open DB handle (empty until opened)
        self._open()

    def _open(self) -> bool:
        """Open the DBs (a read-only Store of an older store may not have them yet: then every
        read is empty until the daemon creates them)."""
        if self._dbs:
            return True
        try:
            self._dbs = {
                n: self.store.env.open_db(n, create=not self.store.readonly) for n in DB_NAMES
            }
        except lmdb.NotFoundError:
            return False
        except lmdb.Error as e:
            raise StoreError(f"{self.store.path}: cannot open the learned-block DBs: {e}") from None
        return True

    def _db(self, name: bytes) -> Any:
        return self._dbs[name]

    def opened(self) -> bool:
        """Whether the store has the learned-block tables (an older one may not, yet)."""
        return self._open()

    def record_count(self) -> int:
        """Learned records of all models (O(1): the table's own count); 0 without the tables."""
        if not self._open():
            return 0
        with self.store.reading() as txn:
            return int(txn.stat(self._db(b"bmeta"))["entries"])

    # -- reads --------------------------------------------------------------------------------

    def _stat_int(self, txn, key: bytes) -> int:
        raw = txn.get(key, db=self._db(b"bstat"))
        return _U64.unpack(bytes(raw))[0] if raw is not None and len(raw) == 8 else 0

    def _unpack_meta(self, txn, key: bytes) -> BlockMeta | None:
        """The record's meta, None if there is none; CorruptEntryError if it is unreadable."""
        raw = txn.get(key, db=self._db(b"bmeta"))
        return None if raw is None else BlockMeta.unpack(key, bytes(raw))

    def _get_meta(self, txn, key: bytes) -> BlockMeta | None:
        try:
            return self._unpack_meta(txn, key)
        except CorruptEntryError:
            return None

    def changes(self) -> int:
        """The store's last write transaction's id: equal between two reads, nothing changed."""
        return int(self.store.env.info()["last_txnid"])

    def links(self, txn, fingerprint: bytes) -> dict[bytes, bytes]:
        """{record key: its parent} of every learned record of the model `fingerprint`, read
        from the `kids` rows' keys in `txn` (nothing decoded). A reader of the store's changes
        walks them all on each change (kvstore.learned.index.LearnedChains), so they come as one
        dict built in one pass (`python -m bench.index_walk` times the walk)."""
        cur = txn.cursor(self._db(b"kids"))
        if not cur.set_range(fingerprint):
            return {}
        return kids_links(map(bytes, cur.iternext(values=False)), fingerprint)

    def meta_in(self, txn, key: bytes) -> BlockMeta | None:
        """Record `key`'s meta in `txn`; None when it is gone or unreadable."""
        return self._get_meta(txn, key)

    def block_tokens(self, txn) -> int:
        """The tokens a record holds in this store (its `block_tokens` when first written)."""
        return self._stat_int(txn, BLOCK_TOKENS) or self.block

    def _kids(self, txn, parent: bytes) -> list[bytes]:
        """The record keys (fingerprint + H(end)) whose start is `parent` (fingerprint + H)."""
        return [parse_kids_row(k).child for k in self._kids_rows(txn, parent)]

    def _kids_rows(self, txn, prefix: bytes) -> Iterator[bytes]:
        """The `kids` rows whose keys start with `prefix` (a fingerprint, or a parent key)."""
        cur = txn.cursor(self._db(b"kids"))
        if cur.set_range(prefix):
            for k in cur.iternext(values=False):
                k = bytes(k)
                if not k.startswith(prefix):
                    return
                yield k

    def lookup(
        self,
        fingerprint: bytes,
        tokens: Sequence[int] | bytes,
        *,
        corrupt: list[CorruptEntryError] | None = None,
    ) -> list[BlockMeta]:
        """The longest chain of stored records that prefixes `tokens`, from position 0. The last
        record may match only partly (the request diverges inside it; its `end` is unchanged):
        the caller serves p + the tokens it shares with it (kvstore.tokens.common_prefix). Stops
        at a missing or unreadable record; the unreadable ones passed on the way are appended to
        `corrupt`, if given."""
        if not self._open():
            return []
        data = packed(tokens)
        n = tk.count(data)
        hashes = chain_hashes(fingerprint, data, self.block)

        def walk(txn) -> list[BlockMeta]:
            chain: list[BlockMeta] = []
            p, hp = 0, hashes[0]
            blobs = self._db(b"bblob")
            while p < n:
                full, partial, best = None, None, 0
                for key in self._kids(txn, pack_key(fingerprint, hp)):
                    try:
                        meta = self._unpack_meta(txn, key)
                    except CorruptEntryError as e:
                        if corrupt is not None:
                            corrupt.append(e)
                        continue
                    if meta is None or meta.start != p:
                        continue
                    blob = txn.get(key, db=blobs)
                    if blob is None or len(blob) != meta.nbytes:
                        if blob is not None and corrupt is not None:
                            corrupt.append(CorruptEntryError(key, _truncated(meta, len(blob))))
                        continue  # missing or truncated: never served
                    if meta.end <= n and (full is None or meta.end > full.end):
                        if meta.tokens == tk.cut(data, p, meta.end) and digest_of(
                            key
                        ) == position_hash(fingerprint, data, meta.end, self.block, hashes):
                            full = meta
                            continue
                    j = tk.common_prefix(meta.tokens, tk.cut(data, p))
                    if j > best:
                        partial, best = meta, j
                if full is not None:
                    chain.append(full)
                    p, hp = full.end, digest_of(full.key)
                    continue
                if partial is not None:
                    chain.append(partial)
                break
            return chain

        with self.store.reading(buffers=True) as txn:
            return walk(txn)

    def stored_end(self, fingerprint: bytes, tokens: Sequence[int] | bytes) -> int:
        """How far `tokens` is covered by a chain of whole stored records (0 if none)."""
        n = tk.count(packed(tokens))
        chain = self.lookup(fingerprint, tokens)
        if chain and (
            chain[-1].end > n
            or chain[-1].tokens != tk.cut(packed(tokens), chain[-1].start, chain[-1].end)
        ):
            chain = chain[:-1]
        return chain[-1].end if chain else 0

    def served(self, chain: list[BlockMeta], tokens: Sequence[int] | bytes) -> int:
        """Tokens of `tokens` a lookup's chain serves (the last record trimmed to the match)."""
        if not chain:
            return 0
        last = chain[-1]
        return last.start + tk.common_prefix(last.tokens, tk.cut(packed(tokens), last.start))

    def read_blobs(
        self, metas: list[BlockMeta], *, corrupt: list[CorruptEntryError] | None = None
    ) -> list[bytes]:
        """Checksummed copies of the records' blobs, in one read transaction. A missing or
        corrupt record ends the list: the caller serves the records before it. A corrupt one
        (not one evicted since the lookup) is appended to `corrupt`, if given."""
        if not metas or not self._open():
            return []

        def fn(txn) -> list[bytes]:
            out = []
            for m in metas:
                blob = txn.get(m.key, db=self._db(b"bblob"))
                if blob is None:
                    break
                why = _blob_problem(m, blob)
                if why is not None:
                    if corrupt is not None:
                        corrupt.append(CorruptEntryError(m.key, why))
                    break
                out.append(bytes(blob))
            return out

        with self.store.reading(buffers=True) as txn:
            return fn(txn)

    def chain_to(self, key: bytes) -> list[BlockMeta]:
        """The chain of records from position 0 up to and including the record `key`, found by
        walking its parents (the `kids` rows that end where each record starts). Raises
        StoreError when a record on the way is missing or unreadable, or the chain's tokens do
        not hash to its keys (nothing partial: an export is all of it or nothing)."""
        if not self._open():
            raise StoreError(f"no learned record {key.hex()}")
        fp = fingerprint_of(key)

        def walk(txn) -> tuple[list[BlockMeta], int]:
            parents: dict[bytes, list[bytes]] = {}  # H(end) -> [H(start)] of this model's rows
            for row in map(parse_kids_row, self._kids_rows(txn, fp)):
                parents.setdefault(digest_of(row.child), []).append(digest_of(row.parent))
            chain: list[BlockMeta] = []
            at = key
            while True:
                meta = self._get_meta(txn, at)
                if meta is None:
                    raise StoreError(f"learned record {at.hex()} is missing or unreadable")
                chain.append(meta)
                if meta.start == 0:
                    break
                ups = [
                    m
                    for h in parents.get(digest_of(at), [])
                    if (m := self._get_meta(txn, pack_key(fp, h))) is not None
                    and m.end == meta.start
                ]
                if not ups:
                    raise StoreError(
                        f"learned record {at.hex()} starts at {meta.start}, and the record "
                        "before it is missing"
                    )
                at = ups[0].key
            return chain[::-1], self._stat_int(txn, BLOCK_TOKENS) or self.block

        with self.store.reading() as txn:
            chain, block = walk(txn)  # hashed as the records were cut
        data = b"".join(m.tokens for m in chain)
        hashes = chain_hashes(fp, data, block)
        for m in chain:
            if digest_of(m.key) != position_hash(fp, data, m.end, block, hashes):
                raise StoreError(f"learned record {m.key.hex()}: its tokens do not hash to its key")
        return chain

    def cut_at(self) -> int:
        """The block size this store's records are cut at (this view's before any is stored)."""
        if not self._open():
            return self.block
        with self.store.reading() as txn:
            return self._stat_int(txn, BLOCK_TOKENS) or self.block

    def learned_bytes(self) -> int:
        if not self._open():
            return 0
        with self.store.reading() as txn:
            return self._stat_int(txn, LEARNED_BYTES)

    def written_today(self, day: str | None = None) -> int:
        if not self._open():
            return 0
        key = b"day:" + (day or today()).encode()
        with self.store.reading() as txn:
            return self._stat_int(txn, key)

    def records(self) -> list[BlockMeta]:
        """Every readable record's meta (stats, eviction, tests)."""
        if not self._open():
            return []

        def fn(txn):
            out = []
            for k, v in txn.cursor(self._db(b"bmeta")):
                try:
                    out.append(BlockMeta.unpack(bytes(k), bytes(v)))
                except CorruptEntryError:
                    continue
            return out

        with self.store.reading() as txn:
            return fn(txn)

    def extended(self) -> set[bytes]:
        """Keys of the records another record starts at (the rest are the ends of chains)."""
        if not self._open():
            return set()
        with self.store.reading() as txn:
            return {
                parse_kids_row(k).parent
                for k in txn.cursor(self._db(b"kids")).iternext(values=False)
            }

    def learned_prefixes(
        self, fingerprint: bytes, *, max_tokens: int, limit: int
    ) -> list[tuple[bytes, int]]:
        """This model's learned prefixes, most recently used first (at most `limit`): the packed
        tokens from position 0 (at most `max_tokens` of them) and the stored length of each. A
        learned prefix ends where a record ends off a block boundary (a learned end) or where
        nothing extends a record; a chain broken on the way is left out (kvstore.reasons)."""
        if not self._open():
            return []

        def fn(txn) -> tuple[dict[bytes, BlockMeta], dict[bytes, bytes], int]:
            metas: dict[bytes, BlockMeta] = {}
            cur = txn.cursor(self._db(b"bmeta"))
            if cur.set_range(fingerprint):
                for k, v in cur:
                    if not bytes(k[:FINGERPRINT_BYTES]) == fingerprint:
                        break
                    try:
                        metas[bytes(k)] = BlockMeta.unpack(bytes(k), bytes(v))
                    except CorruptEntryError:
                        continue
            parent_of = self.links(txn, fingerprint)
            return metas, parent_of, self._stat_int(txn, BLOCK_TOKENS) or self.block

        with self.store.reading() as txn:
            metas, parent_of, block = fn(txn)
        extended = set(parent_of.values())
        ends = [m for m in metas.values() if m.end % block or m.key not in extended]
        ends.sort(key=lambda m: -m.last_used)
        out: list[tuple[bytes, int]] = []
        for m in ends[:limit]:
            tokens = _prefix(m, metas, parent_of)
            if tokens:
                out.append((tk.cut(tokens, 0, max_tokens), m.end))
        return out

    def fingerprints_of(self, models: set[str]) -> dict[bytes, dict | None]:
        """The fingerprints this store holds learned records of these model paths under, each
        with the fingerprint parts its records recorded (None: none recorded)."""
        if not self._open():
            return {}

        def fn(txn) -> dict[bytes, dict | None]:
            out: dict[bytes, dict | None] = {}
            for k, v in txn.cursor(self._db(b"bmeta")):
                fp = bytes(k[:FINGERPRINT_BYTES])
                if fp in out:
                    continue
                try:
                    meta = BlockMeta.unpack(bytes(k), bytes(v))
                except CorruptEntryError:
                    continue
                if meta.extra.model in models:
                    out[fp] = meta.extra.fingerprint_parts
            return out

        with self.store.reading() as txn:
            return fn(txn)

    def stats(self) -> dict[str, Any]:
        """records, learned bytes, bytes written today, chains (records nothing extends)."""
        if not self._open():
            return {"records": 0, "bytes": 0, "written_today": 0, "chains": 0}
        day = b"day:" + today().encode()

        def fn(txn):
            keys = [bytes(k) for k in txn.cursor(self._db(b"bmeta")).iternext(values=False)]
            parents = {
                parse_kids_row(k).parent
                for k in txn.cursor(self._db(b"kids")).iternext(values=False)
            }
            return {
                "records": len(keys),
                "bytes": self._stat_int(txn, LEARNED_BYTES),
                "written_today": self._stat_int(txn, day),
                "chains": sum(k not in parents for k in keys),
            }

        with self.store.reading() as txn:
            return fn(txn)

    def check(self) -> tuple[int, list[CorruptEntryError]]:
        """Verify every learned record: its meta (seal, token count), its blob (length, checksum,
        header) and its chain links (a `kids` row from the record it follows, its tokens hashing
        to its key from position 0). A record no chain from position 0 reaches through good
        records can never be served: it is named too. Returns (records, problems), sorted by
        key; `verify --repair` evicts them (kvstore.ops.evict, through `evict_keys`)."""
        if not self._open():
            return 0, []
        problems: dict[bytes, str] = {}

        def scan(txn):
            problems.clear()  # a read retried after a map resize starts over
            metas, rows = self._check_records(txn, problems)
            links = [bytes(k) for k in txn.cursor(self._db(b"kids")).iternext(values=False)]
            return metas, rows, links, self._stat_int(txn, BLOCK_TOKENS) or self.block

        with self.store.reading(buffers=True) as txn:
            metas, rows, links, block = scan(txn)
        self._check_links(metas, links, block, problems)
        return rows, [CorruptEntryError(k, why) for k, why in sorted(problems.items())]

    def _check_records(self, txn, problems: dict[bytes, str]) -> tuple[dict[bytes, BlockMeta], int]:
        """Every record's meta and blob, each problem filed under its key in `problems`: the
        readable metas and how many meta rows there are."""
        from kvstore.errors import CodecError
        from kvstore.learned.records import inspect

        metas: dict[bytes, BlockMeta] = {}
        rows = 0
        for k, v in txn.cursor(self._db(b"bmeta")):
            rows += 1
            k = bytes(k)
            try:
                metas[k] = BlockMeta.unpack(k, bytes(v))
            except CorruptEntryError as e:
                problems[k] = e.reason
        blob_keys = set()
        for k, blob in txn.cursor(self._db(b"bblob")):
            k = bytes(k)
            blob_keys.add(k)
            m = metas.get(k)
            if m is None:
                if k not in problems:
                    problems[k] = "record blob without meta"
                continue
            why = _blob_problem(m, blob)
            if why is None:
                try:
                    inspect(bytes(blob), m.ntokens, name="record blob")
                except CodecError as e:
                    why = str(e)
            if why is not None:
                problems[k] = why
        for k in metas.keys() - blob_keys:
            problems[k] = "record meta without blob"
        return metas, rows

    def _check_links(
        self,
        metas: dict[bytes, BlockMeta],
        links: list[bytes],
        block: int,
        problems: dict[bytes, str],
    ) -> None:
        """The chains: each record reached from position 0 through good records, at the position
        it starts at, its tokens hashing to its key; the rest filed in `problems`."""
        children: dict[bytes, list[bytes]] = {}  # fingerprint + H(start) -> record keys
        for link in links:
            parent, child = parse_kids_row(link)
            children.setdefault(parent, []).append(child)
            if child not in metas and child not in problems:
                problems[child] = "a chain link to a record that is not stored"
        reached: set[bytes] = set()
        for fp in {fingerprint_of(k) for k in metas}:
            todo = [(pack_key(fp, chain_hashes(fp, b"", block)[0]), 0, b"")]
            while todo:  # depth first from position 0, through good records only
                parent, at, data = todo.pop()
                for child in children.get(parent, []):
                    m = metas.get(child)
                    if m is None or child in problems or child in reached:
                        continue
                    if m.start != at:
                        problems[child] = (
                            f"record [{m.start}, {m.end}) is linked after position {at}"
                        )
                        continue
                    grown = data + m.tokens
                    if digest_of(child) != position_hash(fp, grown, m.end, block):
                        problems[child] = "its tokens do not hash to its key"
                        continue
                    reached.add(child)
                    todo.append((child, m.end, grown))
        for k, m in metas.items():
            if k not in problems and k not in reached:
                problems[k] = (
                    f"record [{m.start}, {m.end}) cannot be served: no chain of good records "
                    "from position 0 reaches it"
                )

    # -- writes -------------------------------------------------------------------------------

    def _add(self, txn, key: bytes, delta: int) -> None:
        value = max(0, self._stat_int(txn, key) + delta)
        txn.put(key, _U64.pack(value), db=self._db(b"bstat"))

    def put_records(
        self,
        fingerprint: bytes,
        tokens: Sequence[int] | bytes,
        records: list[tuple[int, int, bytes]],
        *,
        label: str,
        extra: dict[str, Any] | None = None,
        day: str | None = None,
    ) -> int:
        """Store records (start, end, blob) of `tokens` in one write transaction; returns the
        bytes written (a record already stored is skipped: idempotent)."""
        from kvstore.learned.records import inspect

        if len(fingerprint) != FINGERPRINT_BYTES:
            raise StoreError(f"fingerprint must be {FINGERPRINT_BYTES} bytes")
        data = packed(tokens)
        n = tk.count(data)
        hashes = chain_hashes(fingerprint, data, self.block)
        rows = []
        for start, end, blob in records:
            if not (is_cut(start, end, self.block) and end <= n):
                raise StoreError(
                    f"record [{start}, {end}) is not a cut of the chain (block_tokens="
                    f"{self.block}, {n} tokens given)"
                )
            classes = inspect(blob, end - start, name=f"record [{start}, {end})")
            h0 = position_hash(fingerprint, data, start, self.block, hashes)
            h1 = position_hash(fingerprint, data, end, self.block, hashes)
            rows.append(
                (start, end, blob, classes, pack_key(fingerprint, h0), pack_key(fingerprint, h1))
            )
        now = time.time()
        day_key = b"day:" + (day or today()).encode()
        from kvstore.codec.codec import CODEC_VERSION
        from kvstore.store.entry import blob_checksum

        def fn(txn) -> int:
            stored = self._stat_int(txn, BLOCK_TOKENS)
            if stored and stored != self.block:
                raise StoreError(
                    f"{self.store.path}: its records are cut at {stored} tokens, not {self.block}"
                )
            if not stored:
                txn.put(BLOCK_TOKENS, _U64.pack(self.block), db=self._db(b"bstat"))
            written = 0
            for start, end, blob, classes, parent, key in rows:
                old = self._get_meta(txn, key)
                if (
                    old is not None
                    and old.start == start
                    and old.tokens == tk.cut(data, start, end)
                ):
                    continue
                if old is not None:  # unreadable or a collision: replaced
                    self._add(txn, LEARNED_BYTES, -old.nbytes)
                meta = BlockMeta(
                    key=key, start=start, end=end, tokens=tk.cut(data, start, end),
                    nbytes=len(blob), checksum=blob_checksum(blob), codec=CODEC_VERSION,
                    classes=classes, created=now, last_used=now, hits=0, label=label,
                    extra=EntryExtra.of(extra),
                )  # fmt: skip
                txn.put(key, meta.pack(), db=self._db(b"bmeta"))
                txn.put(key, blob, db=self._db(b"bblob"))
                txn.put(kids_row(parent, key), b"", db=self._db(b"kids"))
                written += len(blob)
            self._add(txn, LEARNED_BYTES, written)
            self._add(txn, day_key, written)
            return written

        return self.store.write(fn)

    def count_written(self, nbytes: int, day: str | None = None) -> None:
        """Add learned bytes written outside records (state snapshots) to the day's counter."""
        day_key = b"day:" + (day or today()).encode()
        self.store.write(lambda txn: self._add(txn, day_key, nbytes))

    def touch(self, keys: list[bytes], *, now: float | None = None) -> int:
        """Mark records used now (last_used, hits + 1); returns how many are still stored."""
        now = now or time.time()

        def fn(txn) -> int:
            n = 0
            for k in set(keys):
                meta = self._get_meta(txn, k)
                if meta is not None:
                    txn.put(k, replace(meta, last_used=now, hits=meta.hits + 1).pack(),
                            db=self._db(b"bmeta"))  # fmt: skip
                    n += 1
            return n

        return self.store.write(fn)

    def delete(self, keys: list[bytes]) -> int:
        """Remove records (and their kids rows); returns bytes freed."""

        def fn(txn):
            freed = 0
            for k in keys:
                freed += self._delete(txn, k)
            self._add(txn, LEARNED_BYTES, -freed)
            return freed

        return self.store.write(fn)

    def evict_keys(self, keys: Sequence[bytes]) -> list[tuple[bytes, BlockMeta | None, bytes]]:
        """Remove these records whatever their state, with the links to them: the door
        kvstore.ops.evict takes for records named by key (`verify --repair`'s). Returns each
        one's key, meta (None: unreadable) and packed tokens from position 0 to its end (b"":
        not known), read before it goes."""
        out: list[tuple[bytes, BlockMeta | None, bytes]] = []
        for k in keys:
            try:
                chain = self.chain_to(k)
                out.append((k, chain[-1], b"".join(m.tokens for m in chain)))
            except StoreError:
                with self.store.reading() as txn:
                    out.append((k, self._get_meta(txn, k), b""))
        self.delete(list(keys))
        return out

    def _delete(self, txn, key: bytes, parent: bytes | None = None) -> int:
        """The one removal of a record (every eviction of one comes here), and of the link to
        it: from `parent`, or whichever links to it (found by scanning its model's rows)."""
        meta = self._get_meta(txn, key)
        raw = txn.get(key, db=self._db(b"bblob"))
        size = meta.nbytes if meta is not None else (len(raw) if raw is not None else 0)
        txn.delete(key, db=self._db(b"bmeta"))
        txn.delete(key, db=self._db(b"bblob"))
        if parent is not None:
            txn.delete(kids_row(parent, key), db=self._db(b"kids"))
        else:  # the kids row needs H(start): scan this fingerprint's rows
            for k in list(self._kids_rows(txn, fingerprint_of(key))):
                if parse_kids_row(k).child == key:
                    txn.delete(k, db=self._db(b"kids"))
        return size

    def drop_covered(
        self, fingerprint: bytes, tokens: Sequence[int] | bytes, *, slack: int = 0
    ) -> list[BlockMeta]:
        """A pin of `tokens` was stored: drop the learned records it makes redundant, so the
        prefix is stored once. Those are the records of its chain that end within len(tokens) +
        `slack` (a learned prefix usually runs a few tokens past the pin: the next turn's header),
        leaf first; a record something else extends stays, and so does every record before it,
        and never one with pins > 0. One write transaction; returns the records dropped."""
        data = packed(tokens)
        n = tk.count(data)
        chain = self.lookup(fingerprint, data)
        covered = []
        for m in chain:
            if m.end <= n and m.tokens == tk.cut(data, m.start, m.end):
                covered.append(m)
            elif (
                m.end <= n + slack
                and tk.common_prefix(m.tokens, tk.cut(data, m.start)) == n - m.start
            ):
                covered.append(m)  # runs at most `slack` tokens past the pin
            else:
                break
        if not covered:
            return []
        hashes = chain_hashes(fingerprint, data, self.block)

        def fn(txn) -> list[BlockMeta]:
            dropped, freed = [], 0
            for m in reversed(covered):
                meta = self._get_meta(txn, m.key)
                if meta is None or meta.pins > 0 or self._kids(txn, m.key):
                    break
                parent = pack_key(
                    fingerprint, position_hash(fingerprint, data, m.start, self.block, hashes)
                )
                freed += self._delete(txn, m.key, parent)
                dropped.append(m)
            self._add(txn, LEARNED_BYTES, -freed)
            return dropped

        return self.store.write(fn)

    def evict_learned(self, max_bytes: int) -> int:
        """`evict_learned_records`' bytes freed."""
        return self.evict_learned_records(max_bytes).freed

    def evict_learned_records(self, max_bytes: int) -> EvictedRecords:
        """Least recently used leaf records (nothing stored extends them) go first, never a
        record with pins > 0, until learned bytes <= max_bytes; returns the bytes freed and the
        records evicted (one write transaction: a retried one starts over)."""
        if not self._open():
            return EvictedRecords(0, [], [])

        def fn(txn) -> EvictedRecords:
            evicted: list[BlockMeta] = []
            total = self._stat_int(txn, LEARNED_BYTES)
            if total <= max_bytes:
                return EvictedRecords(0, evicted, [])
            metas: dict[bytes, BlockMeta] = {}
            for k, v in txn.cursor(self._db(b"bmeta")):
                try:
                    metas[bytes(k)] = BlockMeta.unpack(bytes(k), bytes(v))
                except CorruptEntryError:
                    continue
            kids: dict[bytes, int] = {}
            parent_of: dict[bytes, bytes] = {}
            for k in txn.cursor(self._db(b"kids")).iternext(values=False):
                k = bytes(k)
                parent, child = parse_kids_row(k)
                kids[parent] = kids.get(parent, 0) + 1
                parent_of[child] = parent
            heap = [(m.last_used, k) for k, m in metas.items() if not kids.get(k) and m.pins <= 0]
            heapq.heapify(heap)
            freed = 0
            while heap and total - freed > max_bytes:
                _, k = heapq.heappop(heap)
                m = metas[k]
                up = parent_of.get(k)
                freed += self._delete(txn, k, up)
                evicted.append(m)
                if up is not None and up in metas:
                    kids[up] -= 1
                    if kids[up] == 0 and metas[up].pins <= 0:
                        heapq.heappush(heap, (metas[up].last_used, up))
            self._add(txn, LEARNED_BYTES, -freed)
            return EvictedRecords(freed, evicted, [_prefix(m, metas, parent_of) for m in evicted])

        return self.store.write(fn)


def _prefix(m: BlockMeta, metas: dict[bytes, BlockMeta], parent_of: dict[bytes, bytes]) -> bytes:
    """The packed tokens from position 0 to the end of record `m` (b"" when a record on the way
    is missing)."""
    parts = [m]
    while parts[-1].start > 0:
        up = metas.get(parent_of.get(parts[-1].key, b""))
        if up is None or up.end != parts[-1].start:
            return b""
        parts.append(up)
    return b"".join(p.tokens for p in reversed(parts))


def learned_summary(
    blocks: BlockStore,
    metas: list,
    settings: Settings | Mapping[str, object],
    paused: str | None = None,
) -> dict[str, Any]:
    """What `kvstore stats` shows of learned data: records, bytes against the learned budget,
    today's writes against the daily budget, whether learning is paused, and the learned
    whole-cache entries of state layouts (snapshots: entries with extra.learned). `settings`:
    the Settings, or a mapping as `Settings.of` takes one."""
    budgets = Settings.of(settings)
    s = blocks.stats()
    snaps = [m for m in metas if is_snapshot(m)]
    return {
        "records": s["records"],
        "chains": s["chains"],
        "bytes": s["bytes"],
        "budget": int(budgets.learned_max_bytes),
        "written_today": s["written_today"],
        "write_budget": int(budgets.learn_write_bytes_per_day),
        "paused": paused,
        "snapshots": len(snaps),
        "snapshot_bytes": sum(m.nbytes for m in snaps),
    }


def is_snapshot(meta: Any) -> bool:
    """A learned whole-cache entry (a state layout's boundary): unpinned, extra.learned."""
    return not meta.pinned and meta.extra.learned is True


def _truncated(meta: BlockMeta, got: int) -> str:
    return f"record blob is {got} bytes, its meta says {meta.nbytes}"


def _blob_problem(meta: BlockMeta, blob) -> str | None:
    """Why a record's blob is not what its meta says (None: it is)."""
    from kvstore.store.entry import blob_checksum

    if len(blob) != meta.nbytes:
        return _truncated(meta, len(blob))
    if blob_checksum(blob) != meta.checksum:
        return "record blob checksum mismatch (it was altered)"
    return None


def load_entry(store: Store, key: bytes, tokens: bytes | None = None) -> tuple[Any, list]:
    """`Store.load`, and a state-only snapshot's KV layers put back from its block records: the
    whole cache an entry serves (an old whole-cache snapshot is served as it is)."""
    meta, cache = store.load(key, tokens)
    if meta.extra.kv_layers:
        cache = fill_kv_layers(store, meta, cache)
    return meta, cache


def fill_kv_layers(store: Store, meta: Any, cache: list) -> list:
    """A state-only snapshot (extra.kv_layers) with its KV layers put back from the block
    records of its tokens: the whole cache at its boundary. KeyError when the records no longer
    cover it (evicted): the snapshot is then not served."""
    from kvstore.learned.records import assemble

    layers = [int(i) for i in meta.extra.kv_layers or ()]
    n = tk.count(meta.tokens)
    blocks = BlockStore(store, block=meta.extra.kv_block or DEFAULT.block_tokens)
    corrupt: list[CorruptEntryError] = []
    chain = blocks.lookup(meta.fingerprint, meta.tokens, corrupt=corrupt)
    if corrupt:
        raise corrupt[0]
    if not chain or blocks.served(chain, meta.tokens) < n or chain[-1].end != n:
        raise KeyError(f"{meta.key.hex()}: its KV records are gone")
    blobs = blocks.read_blobs(chain, corrupt=corrupt)
    if len(blobs) < len(chain):
        raise corrupt[0] if corrupt else KeyError(f"{meta.key.hex()}: its KV records are gone")
    kv = assemble(blobs, chain, n, [cache[i] for i in layers])
    out = list(cache)
    for i, layer in zip(layers, kv, strict=True):
        out[i] = layer
    return out
