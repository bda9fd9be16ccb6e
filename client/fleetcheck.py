"""Entries another box computed, fetched by a warm's read-through and stored pending their
semantic check (kvstore.fleet.check), are checked here, by the process that holds the model,
before they are inserted: at start (kvstore.client.load, PersistentPromptCache, `kvstore serve`
before it answers), never on a request. One re-prefill of the first CHECK_TOKENS positions and
SPOT_CHECKS decoding steps at positions drawn past them per entry (check_cache; a state layout's
entry is re-prefilled whole), once: the verdict goes back to the store (the daemon's
`fleet_checked`, else the store here), so later starts insert the entry unchecked again only
because it passed. An entry that fails is not inserted (the app prefills it), is deleted, and its
uploader is quarantined. Without the model (`hydrate` called without `model=`) a pending entry
is skipped, never inserted unchecked.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstore.degrade import library_call
from kvstore.errors import KVStoreError, counted
from kvstore.store.entry import EntryMeta, unchecked

if TYPE_CHECKING:  # `pre` is a kvstore.client.hydrate.Prefetched (which imports this module)
    from kvstore.fleet.check import Checked
    from kvstore.identity.model import ModelIdentity

log = logging.getLogger("kvstore.client")


@dataclass
class Pending:
    """A prefetch's entries held back until `check_pending` has the model."""

    home: Path
    identity: ModelIdentity
    entries: list[tuple[EntryMeta, list]] = field(default_factory=list)


def hold_pending(pre: Any, home: Path, identity: ModelIdentity) -> None:
    """Take the entries pending their check out of `pre.entries` (into `pre.pending`)."""
    held = [e for e in pre.entries if unchecked(e[0])]
    if held:
        pre.entries = [e for e in pre.entries if not unchecked(e[0])]
        pre.pending = Pending(home, identity, held)


def check_pending(pre: Any, model: Any) -> list[Checked]:
    """Check `pre`'s held entries with the loaded `model`; those that pass join `pre.entries`,
    the others go into the report's skipped, and the verdicts are recorded. Never raises."""
    held: Pending | None = pre.pending
    pre.pending = None
    if held is None or not held.entries:
        return []  # the usual start: kvstore.fleet.check is not imported
    from kvstore.fleet.check import Checked, check_cache

    if model is None:
        pre.report.skipped += [
            f"{m.key.hex()}: fetched from {m.extra.uploader or 'the fleet'}, not yet "
            "checked against this box's model (pass model= to hydrate to check it)"
            for m, _ in held.entries
        ]
        if pre.report.warning is None:
            pre.report.warning = (
                f"kvstore: {counted(len(held.entries), 'entry')} fetched from the fleet for "
                f"{pre.model_path} not inserted: not yet checked against this box's model; pass "
                "model= to hydrate (kvstore.client.load and PersistentPromptCache do)"
            )
        return []
    verdicts: list[Checked] = []
    passed = []
    for meta, cache in held.entries:
        what = f"kvstore: fleet check of entry {meta.key.hex()}"
        with library_call(what, level=logging.DEBUG) as failed:  # never take the app down
            v = check_cache(model, held.identity, meta.token_ids(), cache)
        if failed.error is not None:  # the entry is skipped
            pre.report.skipped.append(f"{meta.key.hex()}: its fleet check failed: {failed.error}")
            continue
        uploader = meta.extra.uploader
        verdicts.append(Checked(meta.key, v.ok, v.what, uploader, meta.label))
        if v.ok:
            passed.append((meta, cache))
            log.info("kvstore: fetched entry %r from %s checked against this model in %.3fs: %s",
                     meta.label, uploader, v.seconds, v.what)  # fmt: skip
        else:
            pre.report.skipped.append(
                f"{meta.key.hex()}: its KV is not what this box's model computes ({v.what}); "
                f"refused, and uploader {uploader} quarantined"
            )
            log.error("kvstore: refused fetched entry %r: its KV is not what this box's model "
                      "computes (%s); every object of uploader %s is quarantined",
                      meta.label, v.what, uploader)  # fmt: skip
    if passed:
        pre.entries = sorted(pre.entries + passed, key=lambda e: (e[0].pinned, e[0].last_used))
    _record(held.home, verdicts)
    return verdicts


def _record(home: Path, verdicts: list[Checked]) -> None:
    """The verdicts into the store: through the daemon when one runs (the one writer), else
    here; a failure is one warning (the entries are checked again at the next start)."""
    from kvstore.fleet.check import request_of
    from kvstore.ops.fleet import fleet_checked
    from kvstore.ops.route import Route
    from kvstore.store.store import Store

    if not verdicts:
        return
    req = request_of(verdicts)
    try:
        with Route(home, timeout=10.0) as route:

            def local() -> Any:
                with Store(home) as store:
                    return fleet_checked(store, home, req)

            route.run(req, local)
    except KVStoreError as e:
        log.warning("kvstore: the fleet check of %s is not recorded: %s",
                    counted(len(verdicts), "entry"), e)  # fmt: skip
