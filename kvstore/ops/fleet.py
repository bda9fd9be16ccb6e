"""`fleet_checked`: the semantic check's verdicts on entries fetched from the fleet and pending
their check (kvstore.fleet.check), recorded: the daemon's handler, and the path of a client or
`remote pull` with no daemon."""

from __future__ import annotations

from pathlib import Path

from kvstore.fleet.check import Checked, record_verdicts
from kvstore.store.store import Store
from kvstore.wire.messages import FleetCheckedReply, FleetCheckedRequest


def fleet_checked(store: Store, home: Path, req: FleetCheckedRequest) -> FleetCheckedReply:
    """Passed entries marked so; refused ones deleted, their uploaders quarantined, counted."""
    verdicts = [Checked(k, True, "") for k in req.passed] + [
        Checked(r["key"], False, r.get("what") or "", r.get("uploader"), r.get("label") or "")
        for r in req.refused
    ]
    return FleetCheckedReply(*record_verdicts(store, home, verdicts))
