"""Read-through of learned records on a request's miss, the bucket side: find the longest chain
of a request's prefix the fleet holds, fetch it when that beats prefilling, and verify every
object before a caller may use it (kvstore.fleet.reads is the request side: the check
against the model, the assembly, the put through the daemon).

- **Lookup.** Records are filed under fingerprint + H(end) (kvstore.learned.chain), so the
  candidates are the request's block boundaries past what this box serves. The longest is asked
  first (a conversation another box served: one HEAD), then the rest by bisection: at most
  MAX_LOOKUPS round trips. Presence is taken as monotone (a box uploads a chain's records from
  its start), and a record the fetch then misses ends the chain there.
- **Fetch.** From the found end backwards, one GET a record (a record's object names its start,
  so the next key is H(start)), until the chain meets what this box holds (an end of its local
  chain, or position 0).
- **Only when faster.** Expected fetch = round trips x the moving round-trip estimate + bytes /
  the moving throughput estimate to this endpoint; expected prefill = tokens / this box's measured
  prefill rate for the model. Nothing measured yet: fetch (and measure). The lookup and the fetch
  run on one worker thread; the caller waits until the deadline (the expected prefill, else
  `fetch_deadline`) and then abandons it and prefills: a hung bucket costs a request its deadline
  at most, once, and opens the breaker.
- **Breaker.** A failure (unreachable, timing out, erroring, an abandoned fetch) opens it for
  BREAKER_S: one warning, then quiet; requests meanwhile do not ask. A prefix the fleet does not
  hold is remembered for MISS_S.
- **Refusals.** A record whose MAC fails, that is corrupt or cut short, or whose uploader is
  quarantined here is never returned; each cause is logged once (the object named), not once per
  request.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from kvstore import metrics
from kvstore import tokens as tk
from kvstore.degrade import UNREADABLE
from kvstore.errors import KVStoreError, RemoteError
from kvstore.fleet.objects import (
    HEADER,
    RECORD_MAGIC,
    Remote,
    VerifiedRecord,
    record_name,
    verify_record,
)
from kvstore.learned.chain import chain_hashes, position_hash

log = logging.getLogger("kvstore")

MAX_LOOKUPS = 6  # HEADs per request, at most (the longest first, then bisection)
BREAKER_S = 30.0  # seconds the breaker stays open after a failure
MISS_S = 30.0  # seconds a prefix the fleet lacks is not asked again
MISSES = 256  # prefixes remembered as missing, at most
WEIGHT = 0.3  # a new measurement's weight in the moving estimates
# what a lookup or fetch may raise that is not a bug (Remote words the bucket's failures)
_FAILURES: tuple[type[Exception], ...] = (KVStoreError, OSError, *UNREADABLE)


@dataclass
class Estimate:
    """Moving estimates of one endpoint: round trip (seconds) and throughput (bytes/second)."""

    rtt: float | None = None
    bps: float | None = None

    def note_rtt(self, seconds: float) -> None:
        self.rtt = seconds if self.rtt is None else WEIGHT * seconds + (1 - WEIGHT) * self.rtt

    def note_transfer(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            bps = nbytes / seconds
            self.bps = bps if self.bps is None else WEIGHT * bps + (1 - WEIGHT) * self.bps

    def fetch_s(self, round_trips: int, nbytes: int) -> float | None:
        """Expected seconds of `round_trips` requests moving `nbytes`; None: nothing measured."""
        if self.rtt is None:
            return None
        return round_trips * self.rtt + (nbytes / self.bps if self.bps else 0.0)


@dataclass
class Breaker:
    """Open for BREAKER_S after a failure: one warning the first time, quiet after that."""

    period: float = BREAKER_S
    open_until: float = 0.0
    warned: bool = False
    opened: int = 0

    def allows(self, now: float) -> bool:
        return now >= self.open_until

    @property
    def state(self) -> str:
        return "open" if not self.allows(time.monotonic()) else "closed"

    def failed(self, why: str) -> None:
        self.open_until = time.monotonic() + self.period
        self.opened += 1
        metrics.FLEET_BREAKER.set(1)
        if not self.warned:
            self.warned = True
            log.warning("kvstore: fleet read-through off for %.0f s at a time, requests prefill "
                        "(said once): %s", self.period, why)  # fmt: skip
        else:
            log.debug("kvstore: fleet read-through off again: %s", why)

    def ok(self) -> None:
        self.open_until = 0.0
        metrics.FLEET_BREAKER.set(0)


@dataclass
class Fetched:
    """Objects of a chain, raw, from its start (the end of what this box holds) to `end`."""

    objects: list[tuple[bytes, bytearray]]  # (record key, object bytes), in chain order
    start: int  # where the first one starts
    end: int
    round_trips: int
    nbytes: int


@dataclass
class Ask:
    """One request's question to the fleet."""

    fingerprint: bytes
    tokens: Sequence[int]
    block: int
    have: frozenset[int]  # chain ends this box holds (0 included): where a fetch may stop
    served: int  # tokens memory or the local store serves already
    prefill_tps: float | None  # this box's prefill rate for the model, if measured
    hashes: list[bytes] = field(default_factory=list)


TOTALS_DIR = "fleet-reads"  # HOME/fleet-reads/<pid>.json: each process's totals


class Tally:
    """What read-through did in this process: on /metrics (kvstore.metrics) and, for `kvstore
    remote status`, in `totals`."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, name: str, n: float) -> None:
        with self._lock:
            self.totals[name] = self.totals.get(name, 0) + n
        if name == "round_trips":
            metrics.FLEET_ROUND_TRIPS.inc(n)
        elif name == "fetch_bytes":
            metrics.FLEET_FETCH_BYTES.inc(n)
        elif name == "saved_s":
            metrics.FLEET_SAVED_SECONDS.inc(n)

    def outcome(self, name: str) -> None:
        self.add(name, 1)
        metrics.FLEET_READS.labels(outcome=name).inc()
        if name == "abandoned":
            metrics.FLEET_ABANDONED.inc()

    def write(self, home: Path, breaker: str) -> None:
        """This process's totals into HOME/fleet-reads/<pid>.json (what `remote status` sums)."""
        from kvstore.home.settings import write_atomically

        with self._lock:
            data = {**self.totals, "breaker": breaker, "updated": time.time()}
        folder = home / TOTALS_DIR
        folder.mkdir(mode=0o700, exist_ok=True)
        write_atomically(folder / f"{os.getpid()}.json", json.dumps(data).encode())


def read_totals(home: Path) -> dict[str, Any]:
    """Every process's read-through totals summed; `breaker_open`: processes whose breaker was
    open when each last wrote."""
    out: dict[str, Any] = {"processes": 0, "breaker_open": 0}
    for path in sorted((home / TOTALS_DIR).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        out["processes"] += 1
        out["breaker_open"] += data.pop("breaker", "") == "open"
        data.pop("updated", None)
        for k, v in data.items():
            if isinstance(v, (int, float)):
                out[k] = out.get(k, 0) + v
    return out


def shown_totals(t: dict[str, Any]) -> str:
    """`read_totals` in one line, as `kvstore remote status` shows it."""
    if not t.get("processes"):
        return "no request asked the fleet yet"
    return (
        f"{int(t.get('fetched_tokens', 0))} tokens fetched ({int(t.get('fetch_bytes', 0))} "
        f"bytes) in {int(t.get('round_trips', 0))} round trips; {int(t.get('miss', 0))} misses, "
        f"{int(t.get('slower', 0))} slower than prefill, {int(t.get('abandoned', 0))} "
        f"abandoned, {int(t.get('refused', 0))} refused, {int(t.get('error', 0))} failed; "
        f"{t.get('saved_s', 0.0):.2f} s saved; breaker open in {t['breaker_open']} of "
        f"{t['processes']} processes"
    )


class ReadThrough:
    """One endpoint's read-through: estimates, breaker, misses and the worker thread."""

    def __init__(self, remote: Remote, *, quarantined: Callable[[], dict[str, str]] = dict):
        self.remote = remote
        self.quarantined = quarantined
        self.estimate = Estimate()
        self.breaker = Breaker()
        self.tally = Tally()
        self._misses: OrderedDict[bytes, float] = OrderedDict()
        self._busy: Future | None = None
        self._said: set[str] = set()
        self._lock = threading.Lock()

    # -- the caller's thread ------------------------------------------------------------------

    def read(self, ask: Ask) -> tuple[list[VerifiedRecord], int] | None:
        """The verified records of the longest chain of `ask.tokens` past `ask.served` the fleet
        holds, from an end this box holds, and the tokens they reach; None: prefill."""
        now = time.monotonic()
        if not self.breaker.allows(now) or (self._busy is not None and not self._busy.done()):
            return None
        last = (len(ask.tokens) - 1) // ask.block  # mlx-lm leaves a token to prefill
        first = ask.served // ask.block + 1
        if last < first:
            return None
        ask.hashes = chain_hashes(ask.fingerprint, tk.pack(ask.tokens[: last * ask.block]),
                                  ask.block)  # fmt: skip
        if self._missed(ask.hashes[last], now):
            return None
        tokens = (last - first + 1) * ask.block
        prefill_s = tokens / ask.prefill_tps if ask.prefill_tps else None
        expected = self.estimate.fetch_s(1, 0)
        if prefill_s is not None and expected is not None and expected >= prefill_s:
            self.tally.outcome("slower")
            return None  # one round trip already costs more than prefilling these tokens
        deadline = min(prefill_s or self.remote.settings.fetch_deadline,
                       self.remote.settings.fetch_deadline)  # fmt: skip
        t0 = time.monotonic()
        self._busy = _run(lambda: self._lookup_and_fetch(ask, first, last, prefill_s))
        try:
            got = self._busy.result(timeout=deadline)
        except FutureTimeout:
            self.tally.outcome("abandoned")
            self.breaker.failed(f"a fetch from {self.remote.where()} passed its deadline "
                                f"({deadline:.2f} s, the expected prefill)")  # fmt: skip
            return None
        except _FAILURES as e:
            self.tally.outcome("error")
            self.breaker.failed(str(e))
            return None
        self.breaker.ok()
        found = None if got is None else self._verified(ask, got, prefill_s, time.monotonic() - t0)
        if got is not None and found is None:  # refused: not asked again for a while either
            self._miss(ask.hashes[last])
        return found

    def _verified(
        self, ask: Ask, got: Fetched, prefill_s: float | None, seconds: float
    ) -> tuple[list[VerifiedRecord], int] | None:
        """The objects verified in full (MAC first), in chain order; a refused one ends the
        chain before it."""
        out: list[VerifiedRecord] = []
        keys = self.remote.settings.fleet_keys
        quarantined = self.quarantined() if got.objects else {}
        for key, data in got.objects:
            try:
                v = verify_record(key, data, keys=keys)
            except RemoteError as e:
                self._refused(e.cause, str(e))
                break
            if why := quarantined.get(v.provenance.box):
                self._refused("quarantined", f"learned record {key.hex()}: uploader "
                              f"{v.provenance.box} is quarantined ({why})")  # fmt: skip
                break
            if v.block != ask.block:
                self._refused("cut", f"learned record {key.hex()} was cut at {v.block} "
                              f"tokens, this store at {ask.block}")  # fmt: skip
                break
            out.append(v)
        if not out:
            return None
        n = out[-1].meta.end
        self.tally.outcome("fetched")
        self.tally.add("fetched_tokens", n - got.start)
        if prefill_s is not None:
            share = (n - got.start) / max(1, got.end - got.start)
            self.tally.add("saved_s", max(0.0, prefill_s * share - seconds))
        return out, n

    def _refused(self, cause: str, what: str) -> None:
        self.tally.outcome("refused")
        metrics.FLEET_REFUSED.labels(reason=cause).inc()
        if cause not in self._said:  # one line per cause, not one per request
            self._said.add(cause)
            log.warning("kvstore: fleet read-through: %s; not used, the request prefills", what)

    def not_used(self, ask: Ask) -> None:
        """The caller refused what `read` returned (its check): not asked again for a while."""
        self._miss(ask.hashes[-1])

    def _missed(self, h: bytes, now: float) -> bool:
        with self._lock:
            at = self._misses.get(h)
            if at is not None and now - at < MISS_S:
                return True
            self._misses.pop(h, None)
            return False

    def _miss(self, h: bytes) -> None:
        with self._lock:
            self._misses[h] = time.monotonic()
            while len(self._misses) > MISSES:
                self._misses.popitem(last=False)

    def close(self) -> None:
        """Nothing to wait for: a fetch still running ends on its own (its result dropped)."""

    # -- the worker thread --------------------------------------------------------------------

    def _head(self, ask: Ask, k: int) -> int | None:
        key = ask.fingerprint + ask.hashes[k]
        t = time.monotonic()
        size = self.remote.head(key, name=record_name(self.remote.settings, key))
        self.estimate.note_rtt(time.monotonic() - t)
        self.tally.add("round_trips", 1)
        return size

    def _find(self, ask: Ask, first: int, last: int) -> tuple[int, int, int] | None:
        """(the longest block end the fleet holds in first..last, its object's size, round
        trips), by the longest first and then bisection; None: none of them."""
        trips = 1
        size = self._head(ask, last)
        if size is not None:
            return last, size, trips
        lo, hi, best = first, last - 1, None
        while lo <= hi and trips < MAX_LOOKUPS:
            mid = (lo + hi + 1) // 2
            trips += 1
            got = self._head(ask, mid)
            if got is None:
                hi = mid - 1
            else:
                best, lo = (mid, got), mid + 1
        return None if best is None else (best[0], best[1], trips)

    def _lookup_and_fetch(
        self, ask: Ask, first: int, last: int, prefill_s: float | None
    ) -> Fetched | None:
        found = self._find(ask, first, last)
        if found is None:
            self._miss(ask.hashes[last])
            self.tally.outcome("miss")
            return None
        k, size, trips = found
        end = k * ask.block
        records = max(1, (end - ask.served + ask.block - 1) // ask.block)
        expected = self.estimate.fetch_s(records, records * size)
        if (
            prefill_s is not None
            and expected is not None
            and expected
            >= prefill_s * ((end - ask.served) / max(1, (last - first + 1) * ask.block))
        ):
            self.tally.outcome("slower")
            return None
        return self._fetch_back(ask, end, trips)

    def _fetch_back(self, ask: Ask, end: int, trips: int) -> Fetched | None:
        """GET the chain's records from `end` back to an end this box holds."""
        objects: list[tuple[bytes, bytearray]] = []
        at, nbytes = end, 0
        while at not in ask.have and at > 0 and len(objects) <= len(ask.tokens):
            key = ask.fingerprint + position_hash(ask.fingerprint, ask.tokens, at, ask.block,
                                                  ask.hashes)  # fmt: skip
            name = record_name(self.remote.settings, key)
            try:
                data, seconds = self.remote.fetch(key, name=name)
            except RemoteError as e:
                # vanished since the lookup (S3 names it only in its code) or cut short
                if e.cause == "corrupt" or (e.cause == "error" and "NoSuchKey" in str(e)):
                    self._refused("gone", f"learned record {key.hex()}: {e}")
                    self._miss(ask.hashes[-1])
                    return None
                raise
            trips += 1
            self.tally.add("round_trips", 1)
            self.tally.add("fetch_bytes", len(data))
            self.estimate.note_transfer(len(data), seconds)
            nbytes += len(data)
            start = record_start(data)
            if start is None or start >= at:
                self._refused("corrupt", f"learned record {key.hex()}: unreadable header")
                return None
            objects.append((key, data))
            at = start
        if at not in ask.have:
            return None
        objects.reverse()
        return Fetched(objects, at, end, trips, nbytes)


def _run(work: Callable[[], Fetched | None]) -> Future:
    """`work` on a daemon thread of its own (a fetch abandoned at its deadline never holds up
    the process's exit), its outcome in the future returned."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(work())
        except _FAILURES as e:  # the waiting request words it
            future.set_exception(e)
        finally:  # anything else is a bug: the thread's excepthook shows it; the request prefills
            if not future.done():
                future.set_result(None)

    threading.Thread(target=run, name="kvstore-fleet-read", daemon=True).start()
    return future


def record_start(data: bytes | bytearray) -> int | None:
    """Where a record object's record starts, read from its header alone (unverified: it only
    names the next object to fetch; `verify_record` checks everything); None: not readable."""
    if len(data) < HEADER.size:
        return None
    try:
        magic, _, n = HEADER.unpack_from(data)
        if magic != RECORD_MAGIC or n > len(data) - HEADER.size:
            return None
        head = msgpack.unpackb(bytes(data[HEADER.size : HEADER.size + n]), raw=False)
        prefix = head["prefix"]
    except UNREADABLE:
        return None
    return len(prefix) // tk.SIZE if isinstance(prefix, bytes) else None
