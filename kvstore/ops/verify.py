"""`verify` and `verify --repair`: check every entry and learned record (--repair deletes the
bad ones)."""

from __future__ import annotations

from collections.abc import Callable

from kvstore.learned.blockstore import BlockStore
from kvstore.store.store import Store
from kvstore.wire.messages import Problem, RepairReply


def check(
    store: Store,
    blocks: BlockStore,
    *,
    repair: bool,
    progress: Callable[[int, int], None] | None = None,
) -> RepairReply:
    """Decode every entry and check every record; with `repair` the bad ones are deleted (a
    write: the daemon runs it as one writer job)."""
    entries = len(store.keys())
    problems = store.check(repair=repair, progress=progress)
    records, bad = blocks.check(repair=repair)
    return RepairReply(
        entries=entries,
        problems=[Problem(p.key, p.reason) for p in problems],
        records=records,
        record_problems=[Problem(p.key, p.reason) for p in bad],
    )
