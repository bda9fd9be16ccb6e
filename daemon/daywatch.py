"""Clock-bound pins across midnight: tomorrow's entries are prepared ahead, yesterday's dropped.

A chat template that prints today's date (Llama 3.2, gpt-oss) gives a pin that holds for one
local day (its entry's `valid_date`). Shortly before midnight the writer warms the manifests as
requests of tomorrow render them (purging nothing), so the first request after midnight finds its
entry; once the date has changed, a normal reconcile purges the entries of past days. The clock is
injectable, so tests walk it across midnight.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from kvstore.degrade import daemon_handler
from kvstore.identity.model import ModelIdentity
from kvstore.pins.ownership import owners

log = logging.getLogger("kvstore.daemon")

LEAD = dt.timedelta(minutes=15)  # tomorrow's entries are prepared this long before midnight
CHECK_SECONDS = 30.0  # how often the clock is looked at


class DayWatch:
    """Looks at the clock and submits the warms that keep clock-bound pins valid."""

    def __init__(
        self,
        upkeep: Any,
        manifests: Callable[[], list[Path]],
        submit: Callable[[str, Callable[[], Any]], Future],
        *,
        clock: Callable[[], dt.datetime] | None = None,
        lead: dt.timedelta = LEAD,
        interval: float = CHECK_SECONDS,
    ):
        self.upkeep, self.manifests, self.submit = upkeep, manifests, submit
        self.clock = clock or upkeep.clock
        self.lead, self.interval = lead, interval
        self._pending: Future | None = None
        self._done: set[tuple[str, str]] = set()  # (job, date) already run: no retry loop
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def bound_dates(self) -> dict[tuple, set[str]]:
        """The valid dates stored for each clock-bound manifest pin (owner, model, label): by
        owner, so an app's pin a manifest adopted counts for that manifest as its own would."""
        out: dict[tuple, set[str]] = {}
        for m in self.upkeep.store.metas(errors=[]):
            valid = m.valid_date
            if valid is None:
                continue
            for owner in owners(m):
                if owner.startswith("manifest:"):
                    out.setdefault(
                        (owner, ModelIdentity.of_entry(m).same_model(), m.label), set()
                    ).add(valid)
        return out

    def due(self, now: dt.datetime) -> tuple[str, dt.datetime, bool] | None:
        """The warm the store needs at `now`: (job, the clock to render with, purge) or None."""
        dates = self.bound_dates()
        if not dates:
            return None
        today = now.date().isoformat()
        tomorrow = now.date() + dt.timedelta(days=1)
        if any(min(d) < today or today not in d for d in dates.values()):
            return "date changed", now, True
        midnight = dt.datetime.combine(tomorrow, dt.time(0), now.tzinfo)
        if now >= midnight - self.lead and any(
            tomorrow.isoformat() not in d for d in dates.values()
        ):
            return "prepare tomorrow", midnight, False
        return None

    def tick(self) -> Future | None:
        """Submit the warm that is due now, unless one is still queued or ran for this date."""
        if self._pending is not None and not self._pending.done():
            return None
        now = self.clock()
        due = self.due(now)
        if due is None:
            return None
        job, render_at, purge = due
        mark = (job, render_at.date().isoformat())
        if mark in self._done:
            return None
        self._done.add(mark)
        log.info("clock-bound pins: %s (rendering as of %s)", job, render_at.date())
        self._pending = self.submit(
            f"clock: {job}",
            lambda: self.upkeep.reconcile(
                self.manifests(), cause=f"clock: {job}", now=render_at, purge=purge
            ),
        )
        return self._pending

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvstore-daywatch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            # the clock check must never take the daemon down
            with daemon_handler("clock-bound pins: check failed", logger=log):
                self.tick()
