"""Who keeps an entry: its owners, a list in meta extra ("manifest:<path>" per manifest, "app").

A manifest that finds one of its pins already stored (an app pinned the same tokens) becomes an
owner of that entry; a manifest edit that drops the pin removes only its ownership, and the entry
is deleted only when no owner is left. An app pin keeps what it had before any manifest adopted
it: its pinned flag is remembered when the first manifest adopts it and given back when the last
manifest lets go.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from kvstore.identity.model import ResolvedModel
from kvstore.store.entry import EntryMeta

APP = "app"  # runtime pins and prefixes an app or `kvstore serve` stored, and imports
PINNED_BEFORE = "pinned_before_manifests"  # the pinned flag before the first manifest owner


def manifest_owner(path: str | Path) -> str:
    return f"manifest:{path}"


def owners(meta: EntryMeta) -> list[str]:
    """The entry's owners; entries stored before owners existed get theirs from their source."""
    stored = meta.extra.owners
    if isinstance(stored, list) and all(isinstance(o, str) for o in stored):
        return list(stored)
    if meta.source == "manifest" and meta.manifest:
        return [manifest_owner(meta.manifest)]
    return [APP]


def owning_manifests(meta: EntryMeta) -> list[str]:
    """The paths of the manifests that own the entry (what `kvstore evict` warns about)."""
    return [o.removeprefix("manifest:") for o in _manifests(owners(meta))]


def _manifests(names: list[str]) -> list[str]:
    return [o for o in names if o.startswith("manifest:")]


def adopted(meta: EntryMeta, owner: str) -> EntryMeta | None:
    """The meta with `owner` (a manifest) added and the entry pinned; None if it owns it already."""
    have = owners(meta)
    if owner in have:
        return None
    extra = meta.extra.updated(owners=[*have, owner])
    if not _manifests(have):
        extra = extra.updated({PINNED_BEFORE: meta.pinned})
    return replace(meta, pinned=True, extra=extra)


def released(meta: EntryMeta, owner: str) -> EntryMeta | None:
    """The meta without `owner`; None when no owner is left (the entry is to be deleted)."""
    left = [o for o in owners(meta) if o != owner]
    if not left:
        return None
    extra = meta.extra.updated(owners=left)
    pinned = meta.pinned
    if not _manifests(left):  # back to what the app had before any manifest adopted it
        before = extra.pinned_before_manifests
        pinned, extra = meta.pinned if before is None else before, extra.without(PINNED_BEFORE)
    return replace(meta, pinned=pinned, extra=extra)


def renamed(meta: EntryMeta, model: ResolvedModel) -> EntryMeta:
    """The meta under the model name (and adapter path, overrides) the manifest now gives it,
    and where that resolves here (`model_dir`: what `evict --stale` judges it by): the entry's
    KV is the same (same key), only what the manifest calls its model changed."""
    extra = meta.extra.updated({**model.identity.state, **model.location})
    return replace(meta, model=model.path, extra=extra)
