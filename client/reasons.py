"""What a client process knows for `kvstore.reasons.attribute`: the prompts it saw recently
(a prefix seen but not stored is `not_learned_yet`), tombstones of evictions it was told of,
and whether the store could be read. Attribution itself is pure (kvstore.reasons)."""

from __future__ import annotations

import bisect
import socket
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvstore import metrics
from kvstore.pins.clock import local_now
from kvstore.reasons import Known, Tombstone, attribute, seen_key
from kvstore.wire.daemon_client import socket_path

RECENT_PROMPTS = 64
RECENT_TOKENS = 16384  # of each: a longer shared prefix than this reads as suffix past it
TOMBSTONES = 256


class Attributor:
    def __init__(self) -> None:
        self.recent: deque[bytes] = deque()  # seen_keys in arrival order, to drop the oldest
        self.sorted: list[bytes] = []  # the same, sorted (kvstore.reasons bisects)
        self.tombstones: deque[Tombstone] = deque(maxlen=TOMBSTONES)
        self.unavailable = False
        self.model_changed = ""
        self.other_model: list[tuple[tuple[int, ...], str]] = []  # (tokens, what differs)
        self.dated: dict[tuple[int, ...], str] = {}  # clock-bound stored pins: tokens -> ISO day
        self.write_budget = False
        self.learner: Any = None  # its `paused` (the daemon's last word) says the write budget
        self._lock = threading.Lock()

    def evicted(self, tokens: Sequence[int], by: str, ts: float, entry: str = "") -> None:
        with self._lock:
            self.tombstones.append(Tombstone.of(tokens, by, ts, entry))

    def __call__(
        self,
        prompt: Sequence[int],
        served: int,
        pins: Mapping[tuple[int, ...], str],
        decode: Callable[[Sequence[int]], str] | None = None,
    ) -> list[dict[str, Any]]:
        other_day: list[tuple[tuple[int, ...], str]] = []
        if self.dated:  # a clock-bound pin of another day: other_date, not diverged
            today = local_now().date().isoformat()
            stale = {t for t in pins if self.dated.get(t, today) != today}
            if stale:
                other_day = [(t, f"{pins[t]} ({self.dated[t]})") for t in stale]
                pins = {t: v for t, v in pins.items() if t not in stale}
        with self._lock:
            known = Known(
                pins=pins,
                other_day=other_day,
                seen=self.sorted,
                tombstones=list(self.tombstones),
                unavailable=self.unavailable and not pins,
                model_changed=self.model_changed,
                other_model=self.other_model,
                write_budget=self.write_budget or _write_budget(self.learner),
            )
            spans = attribute(prompt, served, known, decode)
            t = seen_key(prompt, RECENT_TOKENS)  # 4 bytes a token: 64 prompts stay small
            self.recent.append(t)
            bisect.insort(self.sorted, t)
            if len(self.recent) > RECENT_PROMPTS:
                old = self.recent.popleft()
                del self.sorted[bisect.bisect_left(self.sorted, old)]
        for s in spans:
            metrics.PREFILLED_TOKENS.labels(reason=s["reason"]).inc(s["tokens"])
        return spans


def _write_budget(learner: Any) -> bool:
    return getattr(learner, "paused_by", None) == "write_budget"


def after_hydrate(
    attr: Attributor,
    report: Any,
    home: Path | None,
    model: str | None = None,
    dated: Mapping[tuple[int, ...], str] | None = None,
) -> None:
    """What hydrating told: entries of this path under another fingerprint (`model_changed`),
    tombstones of this model's evicted entries (`evicted`), and a daemon that was there but no
    longer answers while nothing is stored (`unavailable`)."""
    attr.other_model = list(getattr(report, "other_model", None) or [])
    attr.dated = dict(dated or {})
    if home is not None and model:
        from kvstore.store import tombstones

        attr.tombstones.extend(tombstones.load(home, model))
    attr.unavailable = home is not None and not getattr(report, "entries", 0) and daemon_gone(home)


def daemon_gone(home: Path) -> bool:
    """The daemon's socket is there (it ran) but nothing accepts on it (killed)."""
    try:
        path = socket_path(home)
    except Exception:
        return False
    if not path.exists():
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
        except OSError:
            return True
    return False
