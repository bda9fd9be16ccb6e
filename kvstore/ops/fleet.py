"""`fleet_checked`: the semantic check's verdicts on entries fetched from the fleet and pending
their check (kvstore.fleet.check), recorded: the daemon's handler, the path of a client or
`remote pull` with no daemon, and a warm that checked what it fetched (`record_verdicts`)."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from kvstore.fleet.check import CHECK_FIELD, MISMATCH, PASSED, Checked, pending
from kvstore.fleet.queue import UploadQueue
from kvstore.ops.evict import evict, fleet_refused
from kvstore.store.entry import EntryMeta
from kvstore.store.store import Store
from kvstore.wire.messages import FleetCheckedReply, FleetCheckedRequest

log = logging.getLogger("kvstore")


def fleet_checked(store: Store, home: Path, req: FleetCheckedRequest) -> FleetCheckedReply:
    """Passed entries marked so; refused ones evicted, their uploaders quarantined, counted."""
    verdicts = [Checked(k, True, "") for k in req.passed] + [
        Checked(r["key"], False, r.get("what") or "", r.get("uploader"), r.get("label") or "")
        for r in req.refused
    ]
    return FleetCheckedReply(*record_verdicts(store, home, verdicts))


def record_verdicts(store: Store, home: Path, verdicts: list[Checked]) -> tuple[int, int]:
    """Record checks of pending entries: a passed one is marked so (never checked again); a refused
    one is evicted (kvstore.ops.evict), its uploader quarantined (kvstore.fleet.queue), and every
    other entry that box uploaded and is still pending here is evicted with it (a look, then
    `kvstore remote release`, lets them be fetched again). Returns (passed, evicted)."""
    passed = [v.key for v in verdicts if v.ok]
    bad = [v for v in verdicts if not v.ok]

    def mark(meta: EntryMeta) -> EntryMeta | None:
        if not pending(meta):
            return None
        return replace(meta, extra=meta.extra.updated({CHECK_FIELD: PASSED}))

    n = store.edit_meta({k: mark for k in passed}) if passed else 0
    if not bad:
        return n, 0
    boxes, refused = {v.uploader for v in bad if v.uploader}, {v.key for v in bad}
    gone = [m for m in store.metas(errors=[])
            if m.key in refused or (pending(m) and m.extra.uploader in boxes)]  # fmt: skip
    evicted = len(evict(home, fleet_refused(), store=store, entries=gone))
    with UploadQueue(home) as queue:
        for v in bad:
            if v.uploader:
                queue.quarantine(v.uploader, f"{v.label}: {v.what} against this box's model")
            queue.count_refusal(MISMATCH)
    for v in bad:
        log.error(
            "remote: refused fetched entry %s %r: its KV is not what this box's model computes "
            "(%s); every object of uploader %s is quarantined (`kvstore remote release %s` after "
            "a look)", v.key.hex(), v.label, v.what, v.uploader or "unknown",
            v.uploader or "BOX",
        )  # fmt: skip
    return n, evicted
