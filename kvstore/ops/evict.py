"""The one eviction: whatever removes entries or learned records (`kvstore evict`, the byte
budgets, the snapshot cap, a pin that covers learned records, the upgrade canary, a refused fleet
check, a stale pin's purge, `verify --repair`) removes them here, and each one leaves the same
three traces: a tombstone (so a later miss on it reads `evicted`, not `cold`), the
`kvstore_evictions` metric by reason, and one log line that says why.

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
from kvstore.learned.blockstore import BlockStore, is_snapshot
from kvstore.store.entry import EntryMeta, unpack_tokens
from kvstore.store.store import Store

log = logging.getLogger("kvstore.daemon")

# a tombstone's `by` (kvstore.home.tombstones has the others)
BY_SNAPSHOT_CAP, BY_PIN, BY_CANARY = "snapshot cap", "pin", "upgrade canary"
BY_FLEET, BY_REPAIR = "fleet check", "verify --repair"


@dataclass(frozen=True)
class Why:
    """Why something is evicted: the tombstone's `by`, the metric's reason label, and what the
    log line says after the colon."""

    by: str | None  # None: no tombstone
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


def stale_pin(manifest: Path) -> Why:
    """A pin its manifest no longer holds, purged by the warm. No tombstone: a request for it is
    explained by what the manifest holds now (another day's rendering, a divergence), which a
    tombstone's `evicted` would hide."""
    return Why(None, "stale_pin", f"a stale pin of {manifest}")


def corrupt(reason: str) -> Why:
    return Why(BY_REPAIR, "corrupt", f"corrupt ({reason})")


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
    unread: Sequence[bytes] = (),
    records: Iterable[EvictedRecord] = (),
    blocks: BlockStore | None = None,
    record_keys: Sequence[bytes] = (),
) -> list[str]:
    """Delete `entries` from `store`, and the entries whose meta could not be read (`unread`:
    no tombstone, their tokens are unknown); learned `records` arrive already removed, by the
    block store's own transaction (a budget's, a pin's), and `record_keys` are removed from
    `blocks` here (a tombstone where the record's chain is known). Each leaves its tombstone,
    metric and log line. Returns the hex keys evicted."""
    records, unread_records = list(records), []
    if record_keys:
        if blocks is None:
            raise ValueError("evicting learned records needs their block store")
        for key, meta, prefix in blocks.evict_keys(record_keys):
            if meta is None:
                unread_records.append(key)
            else:
                records.append(EvictedRecord(meta, prefix))
    if entries or unread:
        if store is None:
            raise ValueError("evicting entries needs their store")
        store.delete([*(m.key for m in entries), *unread])
    if entries and why.by is not None:
        tombstones.note(home, entries, why.by)
    if records and why.by is not None:
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
    for k, what in [*((k, "") for k in unread), *((k, "learned record ") for k in unread_records)]:
        out.append(k.hex())
        metrics.EVICTIONS.labels(reason=why.metric).inc()
        log.info("evicted %s%s (its meta unreadable): %s", what, k.hex(), why.says)
    for r in records:
        rec = r.record
        out.append(rec.key.hex())
        metrics.EVICTIONS.labels(reason=why.metric).inc()
        log.info("evicted learned record %s [%d, %d) (%d bytes): %s", rec.key.hex(), rec.start,
                 rec.end, rec.nbytes, why.says)  # fmt: skip
    return out
