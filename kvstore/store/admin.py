"""The store's administration: `check` (verify, optionally repair, every entry) and `stats`.
Mixed into `kvstore.store.store.Store`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvstore.errors import CorruptEntryError
from kvstore.store.entry import blob_checksum


class StoreAdmin:
    """Check and stats, mixed into `kvstore.store.store.Store`: built on its reads and `delete`."""

    def check(
        self,
        *,
        repair: bool = False,
        decode: bool = True,
        progress: Callable[[int, int], None] | None = None,
    ) -> list[CorruptEntryError]:
        """Verify every entry (meta, length, checksum, full decode); `repair` deletes bad ones."""
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
                    blob = self.read_blob(k)
                    if blob_checksum(blob) != meta.checksum:
                        raise CorruptEntryError(k, "blob checksum mismatch")
            except CorruptEntryError as e:
                problems.append(e)
            except KeyError:
                problems.append(CorruptEntryError(k, "meta without blob"))
            if progress:
                progress(i + 1, len(keys))
        if repair and problems:
            self.delete(p.key for p in problems)
        return problems

    def stats(self) -> dict[str, Any]:
        errors: list = []
        metas = self.metas(errors=errors)
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
