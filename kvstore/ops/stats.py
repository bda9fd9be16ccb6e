"""`stats`: the store's numbers, its learned data, the prefill ledger and the settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvstore.home.settings import Settings
from kvstore.learned.blockstore import BlockStore, learned_summary
from kvstore.store.store import Store
from kvstore.wire.messages import StatsReply


def stats(
    store: Store,
    blocks: BlockStore,
    *,
    settings: Settings,
    ledger: dict[str, Any],
    paused: str | None = None,
    daemon: dict[str, Any] | None = None,
) -> StatsReply:
    """One reply for both callers: the daemon adds its own state (`daemon`) and why learning is
    paused; `ledger` is Ledger.stats()."""
    return StatsReply(
        store=store.stats(),
        settings=settings.table(),
        daemon=daemon,
        ledger=ledger,
        learned=learned_summary(blocks, store.metas(errors=[]), settings, paused),
    )


def empty(home: Path, *, settings: Settings, ledger: dict[str, Any]) -> StatsReply:
    """A home with no store yet."""
    return StatsReply(
        store={"path": str(home / "store"), "entries": 0, "bytes": 0},
        settings=settings.table(),
        ledger=ledger,
    )
