"""`verify` and `verify --repair`: check every entry and learned record (--repair deletes the
bad ones, through the one eviction)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvstore.errors import CorruptEntryError
from kvstore.learned.blockstore import BlockStore
from kvstore.ops.evict import corrupt, evict
from kvstore.store.store import Store
from kvstore.wire.messages import Problem, RepairReply


def check(
    store: Store,
    blocks: BlockStore,
    *,
    home: Path,
    repair: bool,
    progress: Callable[[int, int], None] | None = None,
) -> RepairReply:
    """Decode every entry and check every record; with `repair` the bad ones are deleted (a
    write: the daemon runs it as one writer job)."""
    entries = len(store.keys())
    problems = store.check(progress=progress)
    if repair:
        for p in problems:
            try:
                meta = store.get_meta(p.key)
            except CorruptEntryError:
                meta = None
            if meta is None:
                evict(home, corrupt(p.reason), store=store, unread=[p.key])
            else:
                evict(home, corrupt(p.reason), store=store, entries=[meta])
    records, bad = blocks.check()
    if repair:  # the last of a chain first: its tokens are read through the records before it
        ends = {m.key: m.end for m in blocks.records()}
        for p in sorted(bad, key=lambda p: -ends.get(p.key, 0)):
            evict(home, corrupt(p.reason), blocks=blocks, record_keys=[p.key])
    return RepairReply(
        entries=entries,
        problems=[Problem(p.key, p.reason) for p in problems],
        records=records,
        record_problems=[Problem(p.key, p.reason) for p in bad],
    )
