"""`kvstore serve`'s learned gauges (`kvstore_learned_records`, `kvstore_learned_bytes`,
`kvstore_learned_budget_bytes`, `kvstore_learn_written_today_bytes`), read from the store the
daemon writes, and serve's memory by where it is (`process_memory`). Cheap: the record count is
the records DB's own entry count and the bytes are the block tables' counters (both O(1)); the
learned whole-cache entries (snapshots) are summed again only when the number of entries
changed; and at most once every REFRESH_S seconds, however often /metrics is scraped. Whether
learning is paused is the daemon's to say: left alone here."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from prometheus_client import Gauge

from kvstore import metrics
from kvstore.degrade import serve_hook

log = logging.getLogger("kvstore.serve")

REFRESH_S = 5.0  # seconds a reading of the store's learned figures is reused

# serve's own process only (this module is serve's): a daemon has no such figures to give
MLX_ACTIVE = Gauge("kvstore_mlx_active_bytes", "mlx's buffers in use (mx.get_active_memory)",
                   registry=metrics.REGISTRY)  # fmt: skip
MLX_CACHE = Gauge("kvstore_mlx_cache_bytes", "mlx's freed buffers it keeps for reuse "
                  "(mx.get_cache_memory)", registry=metrics.REGISTRY)  # fmt: skip
PYTHON_BLOCKS = Gauge("kvstore_python_allocated_blocks", "Python's allocated memory blocks "
                      "(sys.getallocatedblocks)", registry=metrics.REGISTRY)  # fmt: skip
MALLOC_IN_USE = Gauge("kvstore_malloc_in_use_bytes", "glibc malloc's bytes in use, heap and "
                      "mapped, over all arenas (mallinfo2 uordblks + hblkhd)",
                      registry=metrics.REGISTRY)  # fmt: skip
MALLOC_FREE = Gauge("kvstore_malloc_free_bytes", "glibc malloc's free bytes held in its heaps "
                    "(mallinfo2 fordblks)", registry=metrics.REGISTRY)  # fmt: skip


def process_memory() -> None:
    """Set serve's memory gauges: mlx's active and cached buffers, Python's allocated blocks,
    and (glibc only) what malloc holds in use and free, so that a soak's reading of RssAnon says
    which part grew (bench.soak). Each is a counter the allocator keeps: no walk of the heap
    beyond mallinfo2's of its free lists."""
    import sys

    mx = sys.modules.get("mlx.core")  # serve has loaded it; never imported here for a scrape
    if mx is not None:
        MLX_ACTIVE.set(mx.get_active_memory())
        MLX_CACHE.set(mx.get_cache_memory())
    PYTHON_BLOCKS.set(sys.getallocatedblocks())
    info = _mallinfo2()
    if info is not None:
        MALLOC_IN_USE.set(info.uordblks + info.hblkhd)
        MALLOC_FREE.set(info.fordblks)


def _mallinfo2() -> Any:
    """glibc's mallinfo2() (2.33+), summed over its arenas; None elsewhere."""
    import ctypes

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                    "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip

    try:
        f = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    f.restype, f.argtypes = Info, []
    return f()


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
        """Set the gauges from the store, unless they were read less than refresh_s ago; the
        memory gauges every time."""
        process_memory()
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
        from kvstore.home.settings import load_settings
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
        budget = int(load_settings(self.home).learned_max_bytes)
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
