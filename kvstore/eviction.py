"""Which entries an eviction removes: filters shared by `kvstore evict` and the daemon's budget.

Filters combine (AND); `to_size` then keeps only the least recently used unpinned entries whose
removal brings the store under that size. Pinned entries are never picked by `to_size`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvstore.errors import KVStoreError
from kvstore.store import EntryMeta


def _ident(m: EntryMeta) -> tuple:
    """The model an entry was made with: EntryMeta.ident() and its load-time overrides."""
    overrides = m.extra.get("model_config")
    return (*m.ident(), json.dumps(overrides, sort_keys=True) if overrides else None)


def _current_fingerprints(metas: Iterable[EntryMeta], home: Path) -> dict[tuple, bytes | None]:
    from kvstore.identity import FileHashCache, model_fingerprint
    from kvstore.settings import FILEHASH_NAME

    cache = FileHashCache(home / FILEHASH_NAME)
    out: dict[tuple, bytes | None] = {}
    for m in metas:
        ident = _ident(m)
        overrides = m.extra.get("model_config")
        if ident not in out:
            model, adapter, kv_bits, group, qstart, _ = ident
            quant = {"kv_group_size": group, "quantized_kv_start": qstart} if kv_bits else {}
            try:
                out[ident] = model_fingerprint(
                    model,
                    adapter_path=adapter,
                    kv_bits=kv_bits,
                    model_config=overrides if isinstance(overrides, dict) else None,
                    hash_cache=cache,
                    **quant,
                ).digest
            except KVStoreError:
                out[ident] = None
    return out


def select_for_eviction(
    metas: Sequence[EntryMeta],
    *,
    keys: Iterable[bytes] = (),
    label: str | None = None,
    model: str | None = None,
    unpinned: bool = False,
    stale: bool = False,
    everything: bool = False,
    to_size: int | None = None,
    home: Path,
) -> list[EntryMeta]:
    """Entries matching every filter given; `to_size` then picks the LRU unpinned ones."""
    chosen = list(metas)
    keys = set(keys)
    if keys:
        chosen = [m for m in chosen if m.key in keys]
    if label is not None:
        chosen = [m for m in chosen if m.label == label]
    if model is not None:
        chosen = [m for m in chosen if m.model == model]
    if unpinned:
        chosen = [m for m in chosen if not m.pinned]
    if stale:
        current = _current_fingerprints(chosen, home)
        chosen = [m for m in chosen if current[_ident(m)] != m.fingerprint]
    if to_size is not None:
        total = sum(m.nbytes for m in metas)
        victims = []
        for m in sorted((m for m in chosen if not m.pinned), key=lambda m: m.last_used):
            if total <= to_size:
                break
            victims.append(m)
            total -= m.nbytes
        chosen = victims
    return chosen
