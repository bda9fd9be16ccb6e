"""The store's write path: put (with where the model resolves in this process), delete, touch,
meta edits and pins, each one transaction through `Store._write`. Mixed into
`kvstore.store.store.Store`."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvstore.codec import CODEC_VERSION
from kvstore.errors import CorruptEntryError, StoreError
from kvstore.store.entry import _META_FIELDS, EntryMeta, blob_checksum, tokens_match_key
from kvstore.store.keys import FINGERPRINT_BYTES, KEY_BYTES


def model_location(model: str, adapter: str | None = None) -> dict[str, str]:
    """Where `model` and `adapter` resolve in this process, as absolute directories (a hub id:
    its snapshot directory): recorded in each entry's extra at put time as `model_dir` and
    `adapter_dir`, so a process with another cwd or HF_HOME (the daemon under launchd) can still
    judge the entry stale or current. What does not resolve here is left out."""
    from kvstore.errors import ModelError
    from kvstore.identity.fingerprint import resolve_model_path

    out: dict[str, str] = {}
    if model:
        try:
            out["model_dir"] = str(resolve_model_path(model))
        except (ModelError, OSError):
            pass
    if adapter:
        adir = Path(adapter).expanduser()
        if adir.is_dir():
            out["adapter_dir"] = str(adir.resolve())
    return out


def with_model_location(fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` with `model_dir`/`adapter_dir` added to extra where not given (see
    model_location)."""
    extra = fields.get("extra") or {}
    if not isinstance(extra, dict) or isinstance(extra.get("model_dir"), str):
        return fields  # a bad extra: put's type check names it
    model, adapter = fields.get("model"), extra.get("adapter")
    if not isinstance(model, str) or not (adapter is None or isinstance(adapter, str)):
        return fields  # put's type check names the field
    return {**fields, "extra": {**model_location(model, adapter), **extra}}


class StoreWrites:
    """Writes, mixed into `kvstore.store.store.Store`: each runs in its `_write` (which grows the
    map)."""

    def put(self, key: bytes, blob: bytes, *, locate: bool = True, **fields: Any) -> EntryMeta:
        """Store one entry; the same key and blob again keeps `created` and hits.

        `locate` records where the model resolves in this process (see model_location); the
        daemon passes False for a client's put, which DaemonClient.put located in the client's
        own cwd and environment: resolving a relative path or hub id here could find another."""
        if len(key) != KEY_BYTES:
            raise StoreError(f"key must be {KEY_BYTES} bytes, got {len(key)}")
        if locate:
            fields = with_model_location(fields)
        now = time.time()
        checksum = blob_checksum(blob)
        extra = fields.pop("extra", {})
        unknown = set(fields) - set(_META_FIELDS)
        if unknown:
            raise StoreError(f"unknown meta field(s): {sorted(unknown)}")

        tokens = fields.get("tokens")
        if not isinstance(tokens, bytes) or len(tokens) % 4:
            raise StoreError("field 'tokens' must be packed uint32 token ids (bytes)")
        if not tokens_match_key(key, tokens):  # every read would refuse it as corrupt
            raise StoreError(f"entry {key.hex()}: key does not match the entry's tokens")
        draft = EntryMeta(
            key=key,
            tokens=tokens,
            ntokens=len(tokens) // 4,
            label=fields.get("label", ""),
            pinned=fields.get("pinned", False),
            model=fields.get("model", ""),
            fingerprint=key[:FINGERPRINT_BYTES],
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
            same = old is not None and old.checksum == checksum and old.tokens == tokens
            meta = replace(
                draft,
                pinned=draft.pinned or bool(same and old.pinned),
                created=old.created if same else now,
                hits=old.hits if same else 0,
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
        """Rewrite some entries' meta in one transaction (owners: kvstore.store.ownership). An edit
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

    def set_pinned(self, keys: Iterable[bytes], pinned: bool) -> int:
        keys = list(keys)

        def fn(txn):
            n = 0
            for k in keys:
                raw = txn.get(k, db=self._meta)
                if raw is not None:
                    meta = EntryMeta.unpack(k, raw)
                    meta.pinned = pinned
                    txn.put(k, meta.pack(), db=self._meta)
                    n += 1
            return n

        return self._write(fn)
