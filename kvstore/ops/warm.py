"""`warm`: reconcile a manifest into the store (the one warm: the CLI's, the daemon's and
`verify --deep`'s), and a warm report on the wire and back."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from kvstore.ops import put as put_ops
from kvstore.ops.budget import Budget
from kvstore.ops.evict import evict, stale_pin
from kvstore.pins.manifest import Manifest
from kvstore.pins.plan import ModelPlan
from kvstore.store.entry import PutFields
from kvstore.store.store import Store
from kvstore.warm.warm import PrefillBounds, WarmReport
from kvstore.wire.daemon_client import DaemonClient
from kvstore.wire.messages import WarmRequest

HERE = "here"  # `fetch`: open the home's fleet tier for this warm (a process with no daemon)


def warm(
    manifest: Manifest,
    store: Store,
    *,
    home: Path,
    progress: Callable[[str], None] | None = None,
    warn: Callable[[str], None] = logging.getLogger("kvstore").warning,
    fetch: Any = HERE,
    budget: Budget | None = None,
    purge: bool = True,
    now: dt.datetime | None = None,
    may_load: Callable[[ModelPlan], str | None] | None = None,
    bounds: PrefillBounds | None = None,
) -> WarmReport:
    """Warm `manifest` into `store`: each pin it stores goes through the put operation, and the
    byte budgets hold at its end. Fetches through the fleet tier: the home's, opened here, or
    the daemon's own (`fetch`, None for none). `may_load` and `bounds` are the daemon's memory
    gate and each pin's prefill bounds (kvstore.warm.warm)."""
    from kvstore.warm.warm import warm as do_warm

    held = budget if budget is not None else Budget.of(store, home)

    def put(key: bytes, blob: bytes, fields: PutFields) -> Any:
        return put_ops.put(store, key, blob, put_ops.located(fields), budget=held)

    def stale(keys: list[bytes]) -> None:
        metas = [m for k in keys if (m := store.get_meta(k)) is not None]
        evict(home, stale_pin(manifest.path), store=store, entries=metas)

    def run(tier: Any) -> WarmReport:
        report = do_warm(manifest, store, home=home, progress=progress, put=put,
                         purge=stale if purge else None, now=now, fetch=tier, may_load=may_load,
                         bounds=bounds)  # fmt: skip
        if tier is not None:
            tier.record([(p.model, p.tokens, p.seconds) for p in report.pins
                         if p.status == "warmed" and p.seconds > 0])  # fmt: skip
        held.enforce()  # purges and settings change too
        return report

    if fetch is not HERE:
        return run(fetch)
    from kvstore.fleet.tier import warm_tier
    from kvstore.ops.fleet import record_verdicts

    with warm_tier(
        home, store, warn=warn, record_checks=partial(record_verdicts, store, home)
    ) as tier:
        return run(tier)


def send(client: DaemonClient, manifest: str | Path) -> WarmReport:
    """Reconcile a manifest in the daemon (it is the writer, and watches the manifest from then
    on) and return its report. Waits for the warm, however long it takes."""
    reply = client.send(WarmRequest(str(Path(manifest).absolute())))
    return reply.reports[0]
