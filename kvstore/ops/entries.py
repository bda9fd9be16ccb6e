"""Listing, evicting and touching entries."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvstore.home.registry import canonical
from kvstore.identity.model import entry_model_name
from kvstore.ops.evict import evict as evict_entries
from kvstore.ops.evict import requested
from kvstore.store.entry import EntryMeta
from kvstore.store.store import Store
from kvstore.wire.messages import EvictReply, EvictRequest, LsRequest, Owned, Unknown


def ls(store: Store, req: LsRequest, errors: list | None = None) -> list[EntryMeta]:
    """The stored entries, each with its model's name as `model` (`entry_model_name`), by the
    request's model (a name: `model_name` of what the user gave) and label (None: any)."""
    out = []
    for m in store.metas(errors=[] if errors is None else errors):
        name = entry_model_name(m.model, m.model_dir)
        if (req.model is None or name == req.model) and (req.label is None or m.label == req.label):
            out.append(m if name == m.model else replace(m, model=name))
    return out


@dataclass
class Evicted:
    """What an evict deleted (`victims`), kept (`unknown`: meta and why) and which manifests still
    name an evicted pin (`owned`)."""

    victims: list[EntryMeta] = field(default_factory=list)
    unknown: list[tuple[EntryMeta, str]] = field(default_factory=list)
    owned: list[Owned] = field(default_factory=list)
    deleted: int = 0

    def reply(self) -> EvictReply:
        return EvictReply(
            evicted=self.deleted,
            bytes=sum(m.nbytes for m in self.victims),
            owned=list(self.owned),
            keys=[m.key.hex() for m in self.victims],
            unknown=[Unknown(m.key.hex(), m.label, m.model, why) for m, why in self.unknown],
        )


def evict(store: Store, req: EvictRequest, *, home: Path, watched: set[Path]) -> Evicted:
    """Select by the request's filters (AND), delete, and say which manifests own an evicted pin
    (`watched`: the canonical manifests a daemon reconciles)."""
    from kvstore.ops.evictable import select_for_eviction  # the store's own modules: not for ls
    from kvstore.pins.ownership import owning_manifests

    out = Evicted()
    out.victims = select_for_eviction(
        store.metas(errors=[]),
        keys=req.keys,
        label=req.label,
        model=req.model,
        unpinned=req.unpinned,
        stale=req.stale,
        to_size=req.to_size,
        home=home,
        unknown=out.unknown,
    )
    out.deleted = len(evict_entries(home, requested(), store=store, entries=out.victims))
    out.owned = [
        Owned(m.label, m.model, path, canonical(path) in watched)
        for m in out.victims
        for path in owning_manifests(m)
    ]
    return out


def started_manifests(home: Path) -> set[Path]:
    """The manifests a daemon started for this home reconciles: the registered ones and the
    home's manifest.toml."""
    from kvstore.errors import KVStoreError
    from kvstore.home.registry import registered
    from kvstore.home.settings import MANIFEST_NAME

    try:
        paths = {r.path for r in registered(home)}
    except KVStoreError:
        paths = set()
    if (home / MANIFEST_NAME).is_file():
        paths.add(canonical(home / MANIFEST_NAME))
    return paths


def touch(store: Store, keys: list[bytes]) -> Any:
    """Entries used now (their last_used and hits)."""
    return store.touch(keys)
