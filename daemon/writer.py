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

from kvstore.errors import KVStoreError

log = logging.getLogger("kvstore.daemon")

POLL_SECONDS = 0.2  # how soon an idle writer notices the stop flag


class ShuttingDown(KVStoreError):
    """The daemon is stopping; the job was not run."""


class Writer:
    def __init__(self) -> None:
        self._jobs: queue.Queue[tuple[str, Callable[[], Any], Future]] = queue.Queue()
        self._closed = False
        self._lock = threading.Lock()  # submit vs close: no job may be queued and never run
        self.current: str | None = None  # name of the job in flight, for stats and logs

    def submit(self, name: str, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._closed:
                fut.set_exception(ShuttingDown("the daemon is shutting down"))
            else:
                self._jobs.put((name, fn, fut))
        return fut

    def run(self, stopping: threading.Event) -> None:
        """Run jobs on the calling thread until `stopping` is set; the job in flight finishes,
        the queued ones fail with ShuttingDown."""
        while not stopping.is_set():
            try:
                name, fn, fut = self._jobs.get(timeout=POLL_SECONDS)
            except queue.Empty:
                continue
            if not fut.set_running_or_notify_cancel():
                continue
            self.current = name
            try:
                fut.set_result(fn())
            except BaseException as e:  # the job's failure is its caller's; the writer lives on
                fut.set_exception(e)
            finally:
                self.current = None
        with self._lock:
            self._closed = True
        while True:
            try:
                _, _, fut = self._jobs.get_nowait()
            except queue.Empty:
                return
            fut.set_exception(ShuttingDown("the daemon is shutting down"))
