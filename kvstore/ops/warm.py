"""`warm`: reconcile a manifest into the store, and a warm report on the wire and back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvstore.pins.manifest import Manifest
from kvstore.store.store import Store
from kvstore.warm.warm import PinResult, Purged, WarmReport
from kvstore.wire.daemon_client import DaemonClient
from kvstore.wire.messages import WarmRequest


def warm(
    manifest: Manifest,
    store: Store,
    *,
    home: Path,
    progress: Callable[[str], None],
    warn: Callable[[str], None],
) -> WarmReport:
    """Warm `manifest` into `store`, fetching through the fleet tier when one is set."""
    from kvstore.fleet.tier import warm_tier
    from kvstore.warm.warm import warm as do_warm

    with warm_tier(home, store, warn=warn) as fetch:
        report = do_warm(manifest, store, home=home, progress=progress, fetch=fetch)
        if fetch is not None:
            fetch.record(report)
    return report


def send(client: DaemonClient, manifest: str | Path) -> WarmReport:
    """Reconcile a manifest in the daemon (it is the writer, and watches the manifest from then
    on) and return its report. Waits for the warm, however long it takes."""
    reply = client.send(WarmRequest(str(Path(manifest).absolute())))
    return report_from_wire(reply.reports[0])


def report_to_wire(report: WarmReport, manifest: Manifest) -> dict[str, Any]:
    d = asdict(report)
    d.update(
        manifest=str(manifest.path),
        warmed=report.warmed,
        failed=len(report.failed),
        deferred=len(report.deferred),
    )
    return d


def report_from_wire(data: dict[str, Any]) -> WarmReport:
    """A daemon's warm report (a map on the wire) back as a WarmReport."""
    return WarmReport(
        pins=[PinResult(**p) for p in data.get("pins", [])],
        purged=[Purged(**p) for p in data.get("purged", [])],
        released=[Purged(**p) for p in data.get("released", [])],
        adopted=data.get("adopted", 0),
        models_loaded=data.get("models_loaded", 0),
        seconds=data.get("seconds", 0.0),
        stopped=data.get("stopped"),
    )
