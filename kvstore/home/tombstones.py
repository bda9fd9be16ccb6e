"""Tombstones of recent evictions: which prefix (its length and a hash of its tokens), of which
model, by what (`byte budget`, `kvstore evict`, ...: kvstore.ops.evict's `Why`) and when, so
that a later miss on it is `evicted` (kvstore.reasons) rather than `cold`. The one eviction writes;
clients read. A small file in the home, rewritten whole (the last MAX_TOMBSTONES). Its rows keep the
layout they were first written with: `digest` as kvstore.reasons.tombstone_digest, `tail` the
last tokens as big-endian uint32 (in memory a Tombstone's tail is packed as kvstore.tokens)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import msgpack

from kvstore import tokens as tk
from kvstore.degrade import UNREADABLE
from kvstore.home.settings import write_atomically
from kvstore.reasons import Tombstone, tail_of, tombstone_digest

log = logging.getLogger("kvstore")

TOMBSTONES_NAME = "evicted.msgpack"
MAX_TOMBSTONES = 512
BY_EVICT, BY_BYTES, BY_LEARNED = "kvstore evict", "byte budget", "learned budget"


UNREADABLE_FILE: tuple[type[Exception], ...] = (OSError, *UNREADABLE)


def _read(home: Path) -> list[dict[str, Any]]:
    try:
        data = msgpack.unpackb((home / TOMBSTONES_NAME).read_bytes(), raw=False)
    except FileNotFoundError:
        return []
    except UNREADABLE_FILE as e:  # a torn or foreign file: start over
        log.warning("tombstones %s: unreadable, ignored (%s)", home / TOMBSTONES_NAME, e)
        return []
    return [t for t in data if isinstance(t, dict)] if isinstance(data, list) else []


def note(home: Path, metas: Iterable[Any], by: str) -> int:
    """Add a tombstone per evicted entry meta (`token_ids()`, `model`, `label`)."""
    rows = []
    for m in metas:
        try:
            rows.append((str(m.model), m.token_ids(), str(m.label)))
        except (AttributeError, TypeError, ValueError):  # a meta without fields, or torn tokens
            continue
    return note_prefixes(home, rows, by)


def note_prefixes(home: Path, rows: Iterable[tuple[str, Sequence[int], str]], by: str) -> int:
    """Add a tombstone per evicted prefix: (model path, its tokens from position 0, entry)."""
    now = time.time()
    new = []
    for model, tokens, entry in rows:
        if len(tokens):
            key = tk.pack(tokens)
            new.append({"model": model, "length": len(tokens), "digest": tombstone_digest(key),
                        "by": by, "ts": now, "entry": entry,
                        "tail": tk.swapped(tail_of(key))})  # fmt: skip
    if not new:
        return 0
    kept = (_read(home) + new)[-MAX_TOMBSTONES:]
    path = home / TOMBSTONES_NAME
    try:
        write_atomically(path, msgpack.packb(kept, use_bin_type=True))
    except OSError as e:  # a tombstone is a diagnostic: never fail the eviction for it
        log.warning("tombstones %s: not written (%s)", path, e)
        return 0
    return len(new)


def load(home: Path, model: str | Iterable[str]) -> list[Tombstone]:
    models = {model} if isinstance(model, str) else set(model)
    out = []
    for t in _read(home):
        try:
            if t["model"] in models:
                tail = t.get("tail", b"")
                ok = isinstance(tail, bytes) and len(tail) % tk.SIZE == 0
                out.append(Tombstone(int(t["length"]), str(t["digest"]), str(t["by"]),
                                     float(t["ts"]), str(t.get("entry", "")),
                                     tk.swapped(tail) if ok else b""))  # fmt: skip
        except (KeyError, TypeError, ValueError):
            continue
    return out
