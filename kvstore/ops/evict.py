"""The one eviction: whatever removes entries or learned records (`kvstore evict`, the byte
budgets, the snapshot cap, a pin that covers learned records, the upgrade canary, a refused fleet
check) removes them here, and each one leaves the same three traces: a tombstone (so a later miss
on it reads `evicted`, not `cold`), the `kvstore_evictions` metric by reason, and one log line
that says why.

The log line is the eviction's record, written where it happens (in the daemon, its log; the
CLI's own path has no handler at INFO, so nothing reaches its output).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore import metrics
from kvstore.home import tombstones
from kvstore.learned.blockstore import is_snapshot
from kvstore.store.entry import EntryMeta, unpack_tokens
from kvstore.store.store import Store

log = logging.getLogger("kvstore.daemon")

# a tombstone's `by` (kvstore.home.tombstones has the others)
BY_SNAPSHOT_CAP, BY_PIN, BY_CANARY = "snapshot cap", "pin", "upgrade canary"
BY_FLEET = "fleet check"


@dataclass(frozen=True)
class Why:
    """Why something is evicted: the tombstone's `by`, the metric's reason label, and what the
    log line says after the colon."""

    by: str
    metric: str
    says: str


def requested() -> Why:
    return Why(tombstones.BY_EVICT, "requested", "requested")


def over_budget(setting: str, budget: int) -> Why:
    by = tombstones.BY_LEARNED if setting == "learned_max_bytes" else tombstones.BY_BYTES
    metric = "learned_budget" if setting == "learned_max_bytes" else "budget"
    return Why(by, metric, f"over the budget {setting}={budget}")


def snapshot_cap(cap: int) -> Why:
    return Why(BY_SNAPSHOT_CAP, "snapshot_cap", f"more than max_snapshots_per_prefix={cap} on "
               "its chain")  # fmt: skip


def under_pin(label: str) -> Why:
    return Why(BY_PIN, "pinned", f"pin {label!r} holds its tokens")


def upgrade_canary(versions: str) -> Why:
    return Why(BY_CANARY, "canary", f"its model's KV is not what {versions} computes")


def fleet_refused() -> Why:
    return Why(BY_FLEET, "fleet_check", "its uploader's KV was refused by this box's model")


@dataclass(frozen=True)
class EvictedRecord:
    """A learned record its block store removed, with the chain's tokens from position 0 to its
    end (packed; empty when they are no longer known)."""

    record: Any  # kvstore.learned.blockstore BlockMeta
    prefix: bytes


def evict(
    home: Path,
    why: Why,
    *,
    store: Store | None = None,
    entries: Sequence[EntryMeta] = (),
    records: Iterable[EvictedRecord] = (),
) -> list[str]:
    """Delete `entries` from `store` (learned records arrive already removed, by the block
    store's own transaction) and leave each one's tombstone, metric and log line. Returns the
    hex keys evicted."""
    records = list(records)
    if entries:
        if store is None:
            raise ValueError("evicting entries needs their store")
        store.delete(m.key for m in entries)
        tombstones.note(home, entries, why.by)
    if records:
        tombstones.note_prefixes(home, [
            (r.record.extra.model or "", unpack_tokens(r.prefix),
             f"learned chain of {r.record.end} tokens")
            for r in records if r.prefix
        ], why.by)  # fmt: skip
    out = []
    for m in entries:
        out.append(m.key.hex())
        metrics.EVICTIONS.labels(reason=why.metric).inc()
        if is_snapshot(m):
            log.info("evicted learned snapshot %s (%d tokens, %d bytes): %s", m.key.hex(),
                     m.ntokens, m.nbytes, why.says)  # fmt: skip
        else:
            used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.last_used))
            log.info("evicted %s %r of %s (%d bytes, last used %s): %s", m.key.hex(), m.label,
                     m.model, m.nbytes, used, why.says)  # fmt: skip
    for r in records:
        rec = r.record
        out.append(rec.key.hex())
        metrics.EVICTIONS.labels(reason=why.metric).inc()
        log.info("evicted learned record %s [%d, %d) (%d bytes): %s", rec.key.hex(), rec.start,
                 rec.end, rec.nbytes, why.says)  # fmt: skip
    return out
