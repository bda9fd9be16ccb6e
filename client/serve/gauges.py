"""`kvstore serve`'s learned gauges (`kvstore_learned_records`, `kvstore_learned_bytes`,
`kvstore_learned_budget_bytes`, `kvstore_learn_written_today_bytes`), read from the store the
daemon writes. Cheap: the record count is the records DB's own entry count and the bytes are the
block tables' counters (both O(1)); the learned whole-cache entries (snapshots) are summed again
only when the number of entries changed; and at most once every REFRESH_S seconds, however often
/metrics is scraped. Whether learning is paused is the daemon's to say: left alone here."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from kvstore import metrics
from kvstore.degrade import serve_hook

log = logging.getLogger("kvstore.serve")

REFRESH_S = 5.0  # seconds a reading of the store's learned figures is reused


class LearnedGauges:
    def __init__(self, home: Path, *, refresh_s: float = REFRESH_S):
        self.home = Path(home)
        self.refresh_s = refresh_s
        self._at = -1e18
        self._lock = threading.Lock()
        self._store: Any = None
        self._blocks: Any = None
        self._snapshots: tuple[int, int] = (-1, 0)  # (entries counted at, snapshot bytes)
        self.reads = 0  # readings of the store (tests: scrapes within REFRESH_S reuse one)

    def refresh(self, *, force: bool = False) -> None:
        """Set the gauges from the store, unless they were read less than refresh_s ago."""
        with self._lock:
            now = time.monotonic()
            if not force and now - self._at < self.refresh_s:
                return
            self._at = now
            # no store yet, or a damaged one: the gauges stay as they were
            with serve_hook("kvstore: learned gauges not read", level=logging.DEBUG) as failed:
                got = self._read()
            if failed.error is not None:
                self.close()
                return
            if got is None:
                return
            self.reads += 1
            metrics.LEARNED_RECORDS.set(got["records"])
            metrics.LEARNED_BYTES.set(got["bytes"])
            metrics.LEARNED_BUDGET.set(got["budget"])
            metrics.WRITTEN_TODAY.set(got["written_today"])

    def _read(self) -> dict[str, int] | None:
        from kvstore.home.settings import DEFAULT, load_settings
        from kvstore.learned.blockstore import BlockStore, is_snapshot
        from kvstore.store.store import Store

        if self._store is None:
            if not (self.home / "store" / "data.mdb").is_file():
                return None  # no store yet: the daemon has not made one
            self._store = Store(self.home, readonly=True)
        store = self._store
        if self._blocks is None:
            self._blocks = BlockStore(store)
        blocks = self._blocks
        budget = int(load_settings(self.home).get("learned_max_bytes",  # type: ignore[call-overload]
                                                  DEFAULT.learned_max_bytes))  # fmt: skip
        n_entries = store.entry_count()
        if n_entries != self._snapshots[0]:
            snaps = sum(m.nbytes for m in store.metas(errors=[]) if is_snapshot(m))
            self._snapshots = (n_entries, snaps)
        records = blocks.record_count()
        return {
            "records": records,
            "bytes": blocks.learned_bytes() + self._snapshots[1],
            "budget": budget,
            "written_today": blocks.written_today(),
        }

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
        self._store = self._blocks = None
        self._snapshots = (-1, 0)
