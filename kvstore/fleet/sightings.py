"""Fleet-wide recurrence: seen-markers in the bucket, so a prefix counts as recurring when it
recurs across the fleet, not only on one box (kvstore.learned.policy says which chain nodes a
request saw first on this box; the daemon's `learn` asks here).

- **Markers.** One empty object per chain node (fingerprint + h_k, a full block boundary at least
  MIN_LCP deep) that some box saw first: `[prefix/]kvstore/v<FORMAT>/seen/<fingerprint hex>/<h_k
  hex>`, outside every model's entry and record listing. Its S3 metadata names the box and, when
  the box has a fleet key, carries an HMAC of the name under it; a box with a key counts only
  markers whose MAC matches one of its keys. A marker only ever counts as one earlier request:
  a forged one can at most make a box learn (and upload) a prefix it saw once. A marker older
  than SEEN_TTL_S does not count, so a lifecycle rule that expires `.../seen/` after a day
  changes nothing.
- **Lookup** (`deepest`, on the `learn` handler's thread, which is the client's write-behind,
  never a request): the shallowest node first (absent: nobody saw this part, 1 HEAD), then the
  deepest, then bisection: at most MAX_LOOKUPS HEADs. It waits LOOKUP_S at most; a lookup that
  fails or passes that opens the breaker for BREAKER_S (one warning, then quiet): learning then
  counts this box's requests only.
- **Marking** (`mark`): the nodes a request saw first here and the fleet did not hold, at most
  MAX_MARKS a request, queued (at most MAX_QUEUED, then dropped: they are hints) and written by
  this module's worker thread, off the request path and off the `learn` reply.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from kvstore.degrade import settle
from kvstore.errors import KVStoreError
from kvstore.fleet.objects import Remote, version_prefix

log = logging.getLogger("kvstore")

SEEN_DIR = "seen"
MAX_LOOKUPS = 6  # HEADs one learn call may make
MAX_MARKS = 16  # markers one learn call may write
MAX_QUEUED = 1024  # markers waiting for the worker, at most
LOOKUP_S = 2.0  # seconds a learn call waits for its lookup
BREAKER_S = 30.0  # seconds fleet-wide learning is off after a failure
SEEN_TTL_S = 86400.0  # seconds a marker counts after it was written
MAC_CONTEXT = b"kvstore-seen-v1\0"


def marker_name(remote: Remote, fingerprint: bytes, node: bytes) -> str:
    """The object name of the seen-marker of chain node `node` (h_k) of a model."""
    return f"{version_prefix(remote.settings)}{SEEN_DIR}/{fingerprint.hex()}/{node.hex()}"


def marker_mac(key: bytes, name: str) -> str:
    return hmac.new(key, MAC_CONTEXT + name.encode(), hashlib.sha256).hexdigest()


def _status(e: Exception) -> int | None:
    response = getattr(e, "response", None)  # botocore's ClientError
    if isinstance(response, dict):
        return response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return None


class Sightings:
    """The bucket's seen-markers of one remote: lookups, writes, the worker and the breaker."""

    def __init__(self, remote: Remote, *, clock: Callable[[], float] = time.time):
        self.remote = remote
        self.clock = clock
        self.counts = {"lookups": 0, "heads": 0, "found": 0, "marked": 0, "dropped": 0}
        self._jobs: deque[tuple[Callable[[], Any], Future, bool]] = deque()  # (work, its
        # future, a marker write)
        self._queued = 0  # marker writes among the jobs
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._open_until = 0.0
        self._warned = False
        self._said: set[str] = set()

    # -- the learn handler's side -------------------------------------------------------------

    def deepest(self, fingerprint: bytes, hashes: list[bytes], lo: int, hi: int) -> int:
        """The deepest node k in lo..hi whose marker the fleet holds (some request passed it),
        else 0; 0 too while the breaker is open or when the lookup fails or passes LOOKUP_S."""
        if not self.allows():
            return 0
        future = self._submit(lambda: self._lookup(fingerprint, hashes, lo, hi), first=True)
        if future is None:
            return 0
        try:
            return future.result(timeout=LOOKUP_S)
        except FutureTimeout:
            self.failed(f"a lookup of {self.remote.where()} passed {LOOKUP_S:g} s")
        except KVStoreError as e:
            self.failed(str(e))
        return 0

    def mark(self, fingerprint: bytes, hashes: list[bytes], nodes: range) -> int:
        """Queue the markers of `nodes` (at most MAX_MARKS, the shallowest); how many."""
        if not self.allows():
            return 0
        n = 0
        for k in list(nodes)[:MAX_MARKS]:
            name = marker_name(self.remote, fingerprint, hashes[k])
            n += self._submit(functools.partial(self._put, name)) is not None
        return n

    def allows(self) -> bool:
        return time.monotonic() >= self._open_until

    def failed(self, why: str) -> None:
        """Off for BREAKER_S: one warning the first time, quiet after that."""
        self._open_until = time.monotonic() + BREAKER_S
        with self._cond:  # what waits would meet the same bucket
            self.counts["dropped"] += self._queued
            self._jobs.clear()
            self._queued = 0
        if not self._warned:
            self._warned = True
            log.warning("remote: fleet-wide learning off for %.0f s at a time, learning counts "
                        "this box's requests only (said once): %s", BREAKER_S, why)  # fmt: skip
        else:
            log.debug("remote: fleet-wide learning off again: %s", why)

    def stop(self, timeout: float = 2.0) -> bool:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)
        return self._thread is None or not self._thread.is_alive()

    # -- the worker ---------------------------------------------------------------------------

    def _submit(self, work: Callable[[], Any], *, first: bool = False) -> Future | None:
        future: Future = Future()
        with self._cond:
            if self._stopping:
                return None
            if not first:
                if self._queued >= MAX_QUEUED:
                    self.counts["dropped"] += 1
                    return None
                self._queued += 1
            (self._jobs.appendleft if first else self._jobs.append)((work, future, not first))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvstore-fleet-seen",
                                                daemon=True)  # fmt: skip
                self._thread.start()
            self._cond.notify()
        return future

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                work, future, is_mark = self._jobs.popleft()
                self._queued -= is_mark
            settle(future, work)  # whatever it raised is the waiting lookup's to see
            error = future.exception() if is_mark else None
            if error is not None:  # nobody waits for a marker: a bug, said here
                log.error("remote: writing a seen-marker failed: %s: %s", type(error).__name__,
                          error, exc_info=error)  # fmt: skip

    def _lookup(self, fingerprint: bytes, hashes: list[bytes], lo: int, hi: int) -> int:
        """The shallowest first (nobody passed it: no deeper one either), the deepest, then
        bisection between them, MAX_LOOKUPS HEADs at most."""
        self.counts["lookups"] += 1
        seen = lambda k: self._seen(marker_name(self.remote, fingerprint, hashes[k]))  # noqa: E731
        if not seen(lo):
            return 0
        if hi == lo or seen(hi):
            self.counts["found"] += 1
            return hi
        best, a, b, trips = lo, lo + 1, hi - 1, 2
        while a <= b and trips < MAX_LOOKUPS:
            mid = (a + b + 1) // 2
            trips += 1
            if seen(mid):
                best, a = mid, mid + 1
            else:
                b = mid - 1
        self.counts["found"] += 1
        return best

    def _seen(self, name: str) -> bool:
        """One HEAD: the marker exists, is younger than SEEN_TTL_S and (with a fleet key) its
        MAC is one of this box's keys."""
        r = self.remote
        self.counts["heads"] += 1
        try:
            res = r.client.head_object(Bucket=r.bucket, Key=name)
        except r.failures as e:
            if _status(e) == 404:
                return False
            raise KVStoreError(f"{r.where()}: looking up seen-marker {name}: {e}") from None
        modified = res.get("LastModified")
        if modified is not None and self.clock() - modified.timestamp() > SEEN_TTL_S:
            return False
        keys = r.settings.fleet_keys
        mac = str(res.get("Metadata", {}).get("mac", ""))
        if keys and not any(hmac.compare_digest(mac, marker_mac(k, name)) for k in keys):
            if "mac" not in self._said:  # once: a forged or foreign marker only fails to count
                self._said.add("mac")
                log.warning("remote: seen-marker %s is not signed by this fleet's key; not "
                            "counted", name)  # fmt: skip
            return False
        return True

    def _put(self, name: str) -> None:
        r = self.remote
        meta = {"box": r.settings.box_id}
        if r.settings.fleet_keys:
            meta["mac"] = marker_mac(r.settings.fleet_keys[0], name)
        try:
            r.client.put_object(Bucket=r.bucket, Key=name, Body=b"", Metadata=meta)
        except r.failures as e:
            self.failed(f"{r.where()}: writing seen-marker {name}: {e}")
            return
        self.counts["marked"] += 1


def expire_markers(remote: Remote, *, dry_run: bool = False, now: float | None = None) -> int:
    """Delete the seen-markers older than SEEN_TTL_S (they no longer count); how many (`dry_run`:
    would go). `kvstore remote gc` runs it."""
    now = time.time() if now is None else now
    prefix = f"{version_prefix(remote.settings)}{SEEN_DIR}/"
    try:
        pages = remote.client.get_paginator("list_objects_v2").paginate(
            Bucket=remote.bucket, Prefix=prefix
        )
        old = [o["Key"] for page in pages for o in page.get("Contents", [])
               if now - o["LastModified"].timestamp() > SEEN_TTL_S]  # fmt: skip
    except remote.failures as e:
        raise KVStoreError(f"{remote.where()}: listing seen-markers: {e}") from None
    return len(old) if dry_run else remote.delete(old)
