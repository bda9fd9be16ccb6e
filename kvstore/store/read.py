"""The store's read path: meta scans, entry loads (checksummed and decoded inside the read
transaction), and blob bytes whole or by range. Mixed into `kvstore.store.store.Store`."""

from __future__ import annotations

from collections.abc import Iterator

from kvstore.errors import ChecksumError, CodecError, CorruptEntryError
from kvstore.store.entry import EntryMeta, blob_checksum


class StoreReads:
    """Reads, mixed into `kvstore.store.store.Store`: each runs in its `_read` (map resizes
    adopted)."""

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
        """Meta and decoded cache of one entry; `tokens` (packed), if given, must match."""

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
        """The stored blob has its meta's length and checksum (no decode: ~30 GB/s)."""

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
        from kvstore.codec import codec  # mlx: only when KV bytes are decoded, not for `ls`

        if blob is None:
            raise CorruptEntryError(key, "meta without blob")
        if len(blob) != meta.nbytes:
            raise CorruptEntryError(key, f"blob is {len(blob)} bytes, meta says {meta.nbytes}")
        try:  # the checksum runs alongside the copy of a large blob, before anything is returned
            cache, _ = codec.decode(blob, name=f"entry {key.hex()}", checksum=meta.checksum)
        except ChecksumError:
            raise CorruptEntryError(key, "blob checksum mismatch") from None
        except CodecError as e:
            raise CorruptEntryError(key, str(e)) from None
        held = codec.cache_tokens(cache)
        if held != meta.ntokens and not (held is None and codec.keeps_no_offset(cache)):
            raise CorruptEntryError(
                key, f"its KV holds {held} tokens but the entry is {meta.ntokens} tokens"
            )
        return cache
