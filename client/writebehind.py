"""Write-behind: send new entries and prefill stats to the daemon from one background thread.

The request path only enqueues a job holding references to already-evaluated arrays; encoding
and the socket happen on the worker. The queue is bounded: when it is full the job is dropped
with a counted warning rather than blocking generation. With no daemon, jobs are dropped after
one warning and the app goes on as if kvstore were not there. A job the daemon refuses is one
warning per condition: the same refusal again (a full disk refusing every stats batch, numbers
aside) is logged at debug until a job goes through.

`start_daemon=True` is socket activation for one-shot processes (the `llm` plugin): when no
process holds the home's daemon lock, `kvstore daemon` is started for the home, detached (its own
session, its log in the home's daemon.log), and jobs wait up to DAEMON_START_WAIT seconds for it
to answer instead of being dropped. The daemon stays running for later processes.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.degrade import library_call
from kvstore.home.settings import resolve_home

log = logging.getLogger("kvstore.client")

QUEUE_SIZE = 16  # jobs waiting for the worker; more are dropped (never block a request)
CLOSE_TIMEOUT = 10.0  # seconds close() waits for queued jobs before abandoning them
DAEMON_START_WAIT = 10.0  # seconds jobs wait for a daemon this process started to answer
NOT_ANSWERING_BACKOFF = 5.0  # seconds no job reconnects after a lock holder did not answer
DAEMON_LOG = "daemon.log"  # in the home: the log of a daemon started by `start_daemon`


@dataclass(frozen=True)
class Job:
    what: str  # for warnings: "pin 'classify'", "3 stats records"
    run: Callable[[Any], Any]  # called on the worker with a connected DaemonClient


class WriteBehind:
    """One worker thread and a bounded queue of jobs for the daemon of `home`."""

    def __init__(
        self,
        home: str | Path | None = None,
        *,
        maxsize: int = QUEUE_SIZE,
        start_daemon: bool = False,
    ):
        self.home = resolve_home(home)
        self.started_daemon: int | None = None  # the pid of the daemon `start_daemon` started
        self._wait_until = 0.0  # jobs wait for a daemon to answer until then (monotonic)
        self._retry_after = 0.0  # no reconnect before then: a lock holder did not answer
        self.sent = 0  # jobs the daemon accepted
        self.dropped = 0  # jobs dropped: queue full or no daemon
        self.failed = 0  # jobs the daemon refused or that broke midway
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize)
        self._cond = threading.Condition()
        self._pending = 0  # submitted and not finished: what flush() waits on
        self._no_daemon_warned = False
        self._refusals: set[str] = set()  # conditions warned of since the last job went through
        self._closed = False
        self._client: Any = None
        # A daemon thread, so an app that never calls close() still exits; atexit flushes it.
        self.thread = threading.Thread(target=self._run, name="kvstore-write-behind", daemon=True)
        self.thread.start()
        atexit.register(self.close)
        if start_daemon and (started := spawn_daemon(self.home)) is not None:
            self.started_daemon = started[0]
            self._wait_until = started[1] + DAEMON_START_WAIT

    def submit(self, job: Job) -> bool:
        """Enqueue without blocking; False (and a counted warning) when it had to be dropped."""
        if self._closed:
            return False
        with self._cond:
            self._pending += 1
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()
            self.dropped += 1
            if self.dropped & (self.dropped - 1) == 0:  # 1, 2, 4, 8...: counted, not a flood
                log.warning(
                    "kvstore: write-behind queue full (%d jobs); dropped %s (%d dropped so far)",
                    self._queue.maxsize,
                    job.what,
                    self.dropped,
                )
            return False
        return True

    def send(self, what: str, request: Any) -> bool:
        """Submit one request for the daemon (a job that sends it), as `submit`."""
        return self.submit(Job(what, lambda client: client.send(request)))

    @property
    def pending(self) -> int:
        """Jobs submitted and not finished yet."""
        return self._pending

    def flush(self, timeout: float = CLOSE_TIMEOUT) -> bool:
        """Wait until every submitted job has finished; False if `timeout` ran out first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float = CLOSE_TIMEOUT) -> bool:
        """Finish queued jobs (waiting at most `timeout`), then stop and join the worker."""
        if self._closed:
            return not self.thread.is_alive()
        self._closed = True
        atexit.unregister(self.close)
        deadline = time.monotonic() + timeout
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self.thread.join(max(0.0, deadline - time.monotonic()))
        if self.thread.is_alive():
            log.warning(
                "kvstore: the daemon did not take %d queued writes within %.0f s; abandoning them",
                self._pending,
                timeout,
            )
            return False
        return True

    # -- the worker --------------------------------------------------------------------------

    def _run(self) -> None:
        import mlx.core as mx

        # This thread's own mlx stream: jobs encode and slice arrays, and mlx streams belong to
        # the thread that made them (without one, a clean interpreter exit can abort in mlx).
        stream = mx.new_stream(mx.default_device())
        try:
            while (job := self._queue.get()) is not None:
                try:
                    with mx.stream(stream):
                        self._do(job)
                finally:
                    with self._cond:
                        self._pending -= 1
                        self._cond.notify_all()
        finally:
            if self._client is not None:
                self._client.close()

    def _do(self, job: Job) -> None:
        client = self._connection()
        if client is None:
            self.dropped += 1
            if not self._no_daemon_warned:
                self._no_daemon_warned = True
                log.warning(
                    "kvstore: no daemon answers on %s; new pins, chains and prefill stats stay in "
                    "this process (start `kvstore daemon` to persist them)",
                    self.home,
                )
            return
        # persisting is best effort: never take the app down
        what = f"kvstore: could not send {job.what} to the daemon"
        with library_call(what, level=logging.DEBUG) as failed:
            job.run(client)
            self.sent += 1
        if failed.error is None:
            self._refusals.clear()
            return
        self.failed += 1
        self._client = None
        client.close()
        e = failed.error
        condition = re.sub(r"\d+", "#", f"{type(e).__name__}: {e}")  # a batch's count aside
        if condition not in self._refusals:
            self._refusals.add(condition)
            log.warning("%s: %s: %s (said once until a write goes through)",
                        what, type(e).__name__, e)  # fmt: skip

    def _connection(self) -> Any:
        # Reconnect per job while none answers: cheap (no socket file, or a refused connect), and
        # a daemon started after the app is picked up without a restart.
        if self._client is None:
            from kvstore.errors import KVStoreError
            from kvstore.wire.daemon_client import connect, lock_holder

            if time.monotonic() < self._retry_after:
                return None
            try:
                self._client = connect(self.home)
                while self._client is None and time.monotonic() < self._wait_until:
                    time.sleep(0.05)  # the daemon this process started is still starting
                    self._client = connect(self.home)
            except KVStoreError as e:  # a busy daemon (too many connections): this job is dropped
                log.debug("kvstore: %s", e)
                return None
            if self._client is None and lock_holder(self.home) is not None:
                # held but silent (stopped, hung): its ping timeout is not paid again per job
                self._retry_after = time.monotonic() + NOT_ANSWERING_BACKOFF
        return self._client


# home -> (the daemon this process started, monotonic start time)
_started: dict[Path, tuple[subprocess.Popen, float]] = {}


def spawn_daemon(home: Path) -> tuple[int, float] | None:
    """Start `kvstore daemon --home HOME` detached when no process holds the home's daemon lock,
    as socket activation would: its (pid, monotonic start time), or None when another process's
    daemon holds the home or it could not start. Once per home and process: a second call returns
    the first one's daemon, so a caller may start it early (before the weights load) and the
    write-behind still waits for it.

    The child runs in its own session (a terminal's Ctrl-C does not stop it), logs to the home's
    daemon.log and outlives this process. Two processes racing here start two daemons; the
    second finds the lock held and exits at once (daemon/exits.py `lock_held`). One that has
    exited since is started again."""
    from kvstore.home.settings import home_problem
    from kvstore.wire.daemon_client import lock_holder

    home = home.absolute()
    if home in _started and _started[home][0].poll() is None:
        return _started[home][0].pid, _started[home][1]
    if lock_holder(home) is not None or home_problem(home) is not None:
        return None
    argv = [sys.executable, "-m", "kvstore", "daemon", "--home", str(home)]
    argv += ["--log-file", str(home / DAEMON_LOG)]
    try:
        child = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True, env=dict(os.environ),
        )  # fmt: skip
    except OSError as e:
        log.warning("kvstore: could not start `kvstore daemon` for %s: %s", home, e)
        return None
    _started[home] = (child, time.monotonic())
    return child.pid, _started[home][1]


def store_entry(
    client: Any,
    fingerprint: bytes,
    tokens: Sequence[int],
    cache: list,
    *,
    model: str,
    template_hash: bytes | None,
    label: str,
    pinned: bool,
    state: Mapping[str, Any] | None,
    source: str,
    extra: Mapping[str, Any] | None = None,
    **more: Any,
) -> int:
    """Encode `cache` and store it through the daemon as the entry of `tokens` under
    `fingerprint`: the one way a client stores an entry (an app's pin or chain, a served system
    prefix, a learned snapshot). Every entry records the runtime versions it was made with;
    `more` (an app pin's `owners`, a snapshot's `learned` ...) goes into its extra, in order.
    Runs on the write-behind's worker; returns the bytes sent."""
    from kvstore.codec import codec
    from kvstore.identity.codehash import runtime_versions
    from kvstore.ops import put as put_ops
    from kvstore.store.entry import entry_fields, entry_key

    classes = codec.cache_classes(cache)
    blob = codec.encode(cache, {"model": model, "tokenizer_config": "{}"})
    fields = entry_fields(
        tokens,
        label=label,
        pinned=pinned,
        model=model,
        template_hash=template_hash,
        classes=classes,
        state=state,
        source=source,
        **more,
        runtime=runtime_versions(),
        extra=extra,
    )
    put_ops.send(client, entry_key(fingerprint, tokens), blob, fields)
    return len(blob)
