"""What a client process knows for `kvstore.reasons.attribute`: the prompts it saw recently
(a prefix seen but not stored is `not_learned_yet`), tombstones of evictions it was told of,
and whether the store could be read. Attribution itself is pure (kvstore.reasons)."""

from __future__ import annotations

import bisect
import logging
import socket
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvstore import metrics
from kvstore import tokens as tk
from kvstore.degrade import library_call
from kvstore.errors import KVStoreError
from kvstore.home.settings import LOCK_NAME
from kvstore.pins.clock import local_now
from kvstore.reasons import Known, SpanRecord, Tombstone, attribute
from kvstore.wire.daemon_client import lock_holder, socket_path

log = logging.getLogger("kvstore.client")

RECENT_PROMPTS = 64
RECENT_TOKENS = 16384  # of each: a longer shared prefix than this reads as suffix past it
TOMBSTONES = 256
CORRUPT = 64  # prefixes whose entry or learned record failed its checks, remembered
LEARNED_PREFIXES = 512  # this model's learned prefixes kept (most recently used)
LEARNED_TOKENS = 4096  # of each: a divergence past this is not told
DECODED = 256  # token windows whose decoded text is kept (a divergence's texts)
LEARNED_REFRESH_S = 10.0  # seconds between re-reads of them (on a thread of their own)


class Attributor:
    def __init__(self) -> None:
        self.recent: deque[bytes] = deque()  # packed, in arrival order, to drop the oldest
        self.sorted: list[bytes] = []  # the same, sorted (kvstore.reasons bisects)
        self.tombstones: deque[Tombstone] = deque(maxlen=TOMBSTONES)
        self.unavailable = False
        self.model_changed = ""
        self.other_model: list[tuple[tuple[int, ...], str]] = []  # (tokens, what differs)
        self.dated: dict[tuple[int, ...], str] = {}  # clock-bound stored pins: tokens -> ISO day
        self.write_budget = False
        self.learner: Any = None  # its `paused` (the daemon's last word) says the write budget
        self.corrupt: deque[tuple[tuple[int, ...], str]] = deque(maxlen=CORRUPT)
        self.learned: list[bytes] = []  # this model's learned prefixes, packed, sorted
        self.learned_ends: dict[bytes, int] = {}  # of those cut at LEARNED_TOKENS: their length
        self._learned_from: tuple[Path, bytes] | None = None  # (home, fingerprint)
        self._learned_at = 0.0
        self._refreshing = False
        # the pins last given, by identity, and their (packed, label): pins change rarely
        self._pins_seen: list[tuple[int, ...]] = []
        self._pin_keys: list[tuple[bytes, str]] = []
        self._decode: Any = None  # the decode last given, and texts it gave (kvstore.reasons)
        self._texts: OrderedDict[tuple[int, ...], str] = OrderedDict()
        self._lock = threading.Lock()

    def evicted(self, tokens: Sequence[int], by: str, ts: float, entry: str = "") -> None:
        with self._lock:
            self.tombstones.append(Tombstone.of(tokens, by, ts, entry))

    def _decoder(self, decode: Callable[[Sequence[int]], str]) -> Callable[[Sequence[int]], str]:
        """`decode`, remembering the texts of recent token windows: a divergence repeats (the
        same date all day), and decoding costs more than the rest of the attribution."""
        if self._decode is not decode:
            self._decode, self._texts = decode, OrderedDict()
        texts = self._texts

        def cached(tokens: Sequence[int]) -> str:
            t = tuple(tokens)
            text = texts.get(t)
            if text is None:
                text = texts[t] = decode(list(t))
                if len(texts) > DECODED:
                    texts.popitem(last=False)
            return text

        return cached

    def _keys_of(self, pins: Mapping[tuple[int, ...], str]) -> list[tuple[bytes, str]]:
        """The pins as (packed, label), kept while the same token tuples come (an identity
        check each: hashing a long tuple costs more than the attribution)."""
        seen = self._pins_seen
        if len(seen) != len(pins) or any(a is not b for a, b in zip(seen, pins, strict=False)):
            self._pins_seen = list(pins)
            self._pin_keys = [(tk.pack(t), str(name)) for t, name in pins.items()]
        return self._pin_keys

    def failed_checks(self, tokens: Sequence[int], what: str) -> None:
        """A stored entry or learned record of this prefix failed its checks (`corrupt`)."""
        with self._lock:
            self.corrupt.append((tuple(tokens), what))

    def learned_from(self, home: Path, fingerprint: bytes) -> None:
        """Read this model's learned prefixes now, and again every LEARNED_REFRESH_S (off the
        request path)."""
        self._learned_from = (Path(home), fingerprint)
        self._read_learned()

    def _read_learned(self) -> None:
        try:
            with library_call("kvstore: learned prefixes not read", level=logging.DEBUG):
                if self._learned_from is None:
                    return
                home, fp = self._learned_from
                keys, ends = read_learned(home, fp)
                with self._lock:
                    self.learned, self.learned_ends = keys, ends
        finally:
            self._learned_at = time.monotonic()
            self._refreshing = False

    def _refresh_learned(self) -> None:
        if self._learned_from is None or self._refreshing:
            return
        if time.monotonic() - self._learned_at < LEARNED_REFRESH_S:
            return
        self._refreshing = True
        threading.Thread(target=self._read_learned, name="kvstore-learned-prefixes",
                         daemon=True).start()  # fmt: skip

    def __call__(
        self,
        prompt: Sequence[int],
        served: int,
        pins: Mapping[tuple[int, ...], str],
        decode: Callable[[Sequence[int]], str] | None = None,
    ) -> list[SpanRecord]:
        if decode is not None:
            decode = self._decoder(decode)
        other_day: list[tuple[tuple[int, ...], str]] = []
        if self.dated:  # a clock-bound pin of another day: other_date, not diverged
            today = local_now().date().isoformat()
            stale = {t for t in pins if self.dated.get(t, today) != today}
            if stale:
                other_day = [(t, f"{pins[t]} ({self.dated[t]})") for t in stale]
                pins = {t: v for t, v in pins.items() if t not in stale}
        key = tk.pack(prompt)
        with self._lock:
            known = Known(
                pins=pins,
                pin_keys=self._keys_of(pins),
                other_day=other_day,
                seen=self.sorted,
                tombstones=list(self.tombstones),
                unavailable=self.unavailable and not pins,
                model_changed=self.model_changed,
                other_model=self.other_model,
                write_budget=self.write_budget or _write_budget(self.learner),
                learned=self.learned,
                learned_ends=self.learned_ends,
                corrupt=[*self.corrupt, *_corrupt(self.learner)],
            )
            spans = attribute(prompt, served, known, decode, key=key)
            t = tk.cut(key, 0, RECENT_TOKENS)  # 64 prompts stay small
            self.recent.append(t)
            bisect.insort(self.sorted, t)
            if len(self.recent) > RECENT_PROMPTS:
                old = self.recent.popleft()
                del self.sorted[bisect.bisect_left(self.sorted, old)]
        for s in spans:
            metrics.PREFILLED_TOKENS.labels(reason=s["reason"]).inc(s["tokens"])
        self._refresh_learned()
        return spans


def _write_budget(learner: Any) -> bool:
    return getattr(learner, "paused_by", None) == "write_budget"


def _corrupt(learner: Any) -> list[tuple[tuple[int, ...], str]]:
    """The prefixes the learner's cold tier found a corrupt record or entry in."""
    cold = getattr(learner, "cold", None)
    return list(getattr(cold, "corrupt", None) or ())


def read_learned(home: Path, fingerprint: bytes) -> tuple[list[bytes], dict[bytes, int]]:
    """This model's learned prefixes in the store of `home`, as `Known.learned` takes them
    (none when there is no store yet)."""
    from kvstore.errors import KVStoreError
    from kvstore.learned.blockstore import BlockStore
    from kvstore.store.store import Store

    try:
        store = Store(home, readonly=True)
    except (KVStoreError, OSError):
        return [], {}
    with store:
        got = BlockStore(store).learned_prefixes(
            fingerprint, max_tokens=LEARNED_TOKENS, limit=LEARNED_PREFIXES
        )
    keys, ends = [], {}
    for packed, end in got:
        keys.append(packed)
        if tk.count(packed) < end:
            ends[packed] = end
    return sorted(keys), ends


def other_fingerprints(
    home: Path, fingerprint: bytes, model: str, parts: Mapping[str, Any]
) -> list[tuple[tuple[int, ...], str]]:
    """This model path's learned prefixes under another fingerprint, each with what differs
    from the running identity (`model_changed`; entries are hydrate's to tell)."""
    from kvstore.errors import KVStoreError
    from kvstore.learned.blockstore import BlockStore
    from kvstore.reasons import identity_diff
    from kvstore.store.store import Store

    try:
        store = Store(home, readonly=True)
    except (KVStoreError, OSError):
        return []
    out = []
    with store:
        blocks = BlockStore(store)
        wanted = {str(model), str(Path(model).expanduser().resolve())}
        for fp, stored in blocks.fingerprints_of(wanted).items():
            if fp == fingerprint:
                continue
            what = identity_diff(stored, parts) if stored is not None else "fingerprint"
            for packed, _ in blocks.learned_prefixes(fp, max_tokens=LEARNED_TOKENS, limit=64):
                out.append((tuple(tk.unpack(packed)), what))
    return out


def after_hydrate(
    attr: Attributor,
    report: Any,
    home: Path | None,
    model: str | None = None,
    dated: Mapping[tuple[int, ...], str] | None = None,
    parts: Mapping[str, Any] | None = None,
) -> None:
    """What hydrating told: entries of this path under another fingerprint (`model_changed`),
    tombstones of this model's evicted entries (`evicted`), a daemon that was there but no
    longer answers while nothing is stored (`unavailable`), entries that failed their checks
    (`corrupt`); and this model's learned prefixes are read (`diverged`)."""
    attr.other_model = list(getattr(report, "other_model", None) or [])
    attr.dated = dict(dated or {})
    if home is not None and model:
        from kvstore.home import tombstones

        attr.tombstones.extend(tombstones.load(home, model))
    attr.unavailable = home is not None and not getattr(report, "entries", 0) and daemon_gone(home)
    for tokens, label in getattr(report, "corrupt", None) or ():
        attr.failed_checks(tokens, f"entry {label!r}")
    fp = getattr(report, "fingerprint", "")
    if home is not None and fp:
        attr.learned_from(home, bytes.fromhex(fp))
        if model and parts is not None and not getattr(report, "entries", 0) and not attr.learned:
            # nothing stored for this identity: learned under another one of this path?
            what = "kvstore: learned prefixes of other fingerprints not read"
            with library_call(what, level=logging.DEBUG):
                attr.other_model += other_fingerprints(home, bytes.fromhex(fp), model, parts)


def daemon_gone(home: Path) -> bool:
    """A daemon ran on this home and is gone: its socket is there but nothing accepts on it
    (killed), or its lock file is there and no process holds it (killed before it made its
    socket, or stopped)."""
    try:
        path = socket_path(home)
    except (KVStoreError, OSError, RuntimeError):  # no socket path; Path.home() without HOME
        return False
    if path.exists():
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            try:
                s.connect(str(path))
            except OSError:
                return True
        return False
    return (Path(home) / LOCK_NAME).exists() and lock_holder(home) is None
