"""The store's one writer: runs write jobs one at a time, in order, on the main thread.

Every store write of the daemon (puts, deletes, touches, warms, evictions, the ledger) is a job
here, so a warm never interleaves with a client's put and the budget is checked against a store
that nothing else is changing. The jobs run on the main thread because mlx evaluated on another
thread can abort the process at exit ("terminate called without an active exception", seen with
mlx 0.32 on Linux), and warms and put verification evaluate mlx arrays.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from kvstore.degrade import settle
from kvstore.errors import KVStoreError, StoreDamaged

log = logging.getLogger("kvstore.daemon")

POLL_SECONDS = 0.2  # how soon an idle writer notices the stop flag


class ShuttingDown(KVStoreError):
    """The daemon is stopping; the job was not run."""


class Writer:
    def __init__(self) -> None:
        self._jobs: queue.Queue[tuple[str, Callable[[], Any], Future, bool]] = queue.Queue()
        self._closed = False
        self._lock = threading.Lock()  # submit vs close: no job may be queued and never run
        self.current: str | None = None  # name of the job in flight, for stats and logs

    def submit(self, name: str, fn: Callable[[], Any], *, reported: bool = False) -> Future:
        """Queue `fn`; its result or exception goes to the returned Future. A failure is logged
        here unless `reported` (a caller that waits and logs it itself): a job nobody waits on
        (the boot reconcile, a watcher's) would otherwise fail without a word."""
        fut: Future = Future()
        with self._lock:
            if self._closed:
                fut.set_exception(ShuttingDown("the daemon is shutting down"))
            else:
                self._jobs.put((name, fn, fut, reported))
        return fut

    def run(self, stopping: threading.Event) -> None:
        """Run jobs on the calling thread until `stopping` is set; the job in flight finishes,
        the queued ones fail with ShuttingDown."""
        while not stopping.is_set():
            try:
                name, fn, fut, reported = self._jobs.get(timeout=POLL_SECONDS)
            except queue.Empty:
                continue
            if not fut.set_running_or_notify_cancel():
                continue
            self.current = name
            try:
                settle(fut, fn)  # the job's failure is its caller's; the writer lives on
                if not reported and (e := fut.exception()) is not None:
                    if not isinstance(e, StoreDamaged):  # the daemon says that once, and stops
                        log.error("writer: job %s failed", name, exc_info=e)
            finally:
                self.current = None
        with self._lock:
            self._closed = True
        while True:
            try:
                _, _, fut, _ = self._jobs.get_nowait()
            except queue.Empty:
                return
            fut.set_exception(ShuttingDown("the daemon is shutting down"))
