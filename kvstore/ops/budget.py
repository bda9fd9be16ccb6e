"""Holding the store's byte budgets: after every write of an entry or learned records (kvstore.ops
.put), what is over `learned_max_bytes` and then `max_bytes` is evicted, least recently used
first, through kvstore.ops.evict. Pins are never evicted."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from kvstore.home.settings import Settings
from kvstore.learned.blockstore import BlockStore, is_snapshot
from kvstore.ops.evict import EvictedRecord, evict, over_budget
from kvstore.ops.evictable import select_for_eviction
from kvstore.store.store import Store

log = logging.getLogger("kvstore.daemon")


class Budget:
    """The budgets of one store: `enforce()` after each write."""

    def __init__(self, store: Store, blocks: BlockStore, home: Path, settings: Settings):
        self.store, self.blocks, self.home, self.settings = store, blocks, home, settings
        self._pins_over_budget = False  # said once, until it holds again

    @classmethod
    def of(cls, store: Store, home: Path) -> Budget:
        """The budgets as the home's settings set them (a process with no daemon writing)."""
        from kvstore.home.settings import load_settings

        settings = load_settings(home)
        return cls(store, BlockStore(store, block=int(settings.block_tokens)), home, settings)

    def enforce(self) -> list[str]:
        """Hold the learned budget (learned_max_bytes: leaf records and learned snapshot entries,
        least recently used first), then the store's (max_bytes: unpinned entries LRU, then
        learned records). Returns the hex keys evicted."""
        budget = int(self.settings.max_bytes)
        metas = self.store.metas(errors=[])
        evicted = self._enforce_learned(metas)
        if evicted:
            gone = set(evicted)
            metas = [m for m in metas if m.key.hex() not in gone]
        learned = self.blocks.learned_bytes()
        total = sum(m.nbytes for m in metas) + learned
        if total > budget:
            victims = select_for_eviction(metas, to_size=max(0, budget - learned), home=self.home)
            why = over_budget("max_bytes", budget)
            evicted += evict(self.home, why, store=self.store, entries=victims)
            kept = sum(m.nbytes for m in metas) - sum(m.nbytes for m in victims)
            if kept + learned > budget:
                evicted += self._evict_records(max(0, budget - kept), "max_bytes", budget)
        pinned = sum(m.nbytes for m in metas if m.pinned)
        over = pinned > budget
        if over and not self._pins_over_budget:
            log.warning(
                "pins alone hold %d bytes, over the budget max_bytes=%d: pins are never "
                "evicted automatically; raise max_bytes or pin less",
                pinned,
                budget,
            )
        self._pins_over_budget = over
        return evicted

    def _evict_records(self, to_bytes: int, setting: str, budget: int) -> list[str]:
        freed, records, prefixes = self.blocks.evict_learned_records(to_bytes)
        gone = [EvictedRecord(r, p) for r, p in zip(records, prefixes, strict=False)]
        # records count as learned_budget evictions under either budget, as they always have
        why = replace(over_budget(setting, budget), metric="learned_budget")
        return evict(self.home, why, records=gone if freed else [])

    def _enforce_learned(self, metas: list) -> list[str]:
        """Learned data over learned_max_bytes: leaf records go first, then snapshots (LRU)."""
        budget = int(self.settings.learned_max_bytes)
        snaps = sorted((m for m in metas if is_snapshot(m)), key=lambda m: m.last_used)
        snap_bytes = sum(m.nbytes for m in snaps)
        evicted = self._evict_records(max(0, budget - snap_bytes), "learned_max_bytes", budget)
        over = self.blocks.learned_bytes() + snap_bytes - budget
        drop = []
        for m in snaps:
            if over <= 0:
                break
            drop.append(m)
            over -= m.nbytes
        why = over_budget("learned_max_bytes", budget)
        return evicted + evict(self.home, why, store=self.store, entries=drop)
