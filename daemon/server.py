"""`kvstore daemon`: the store's one writer, serving a unix socket in the foreground.

Threads: the main thread handles signals and runs the writer (daemon/writer.py: every store
write, in order); an acceptor thread takes connections; one thread per connection reads frames
and answers them; the watcher thread turns file changes into reconcile jobs. Shutdown stops
accepting, lets the write in flight finish, closes LMDB and removes the socket; a warm stops
between prefill chunks (docs/daemon.md, "Shutdown").
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from kvstore import metrics
from kvstore.daemon import exits
from kvstore.daemon.commands import Commands
from kvstore.daemon.connection import Connection
from kvstore.daemon.daywatch import DayWatch
from kvstore.daemon.learn import Learning
from kvstore.daemon.lifecycle import (
    check_peer,
    cred_layout,
    rss_bytes,
)
from kvstore.daemon.upkeep import Upkeep, watched_files
from kvstore.daemon.writer import Writer
from kvstore.degrade import daemon_handler
from kvstore.errors import KVStoreError, ProtocolError, StoreDamaged, counted
from kvstore.home.ledger import Ledger
from kvstore.home.registry import canonical
from kvstore.home.settings import STORE_DIR, Settings, load_settings
from kvstore.store.store import Store
from kvstore.wire import protocol
from kvstore.wire.codes import ErrorCode
from kvstore.wire.messages import READS

log = logging.getLogger("kvstore.daemon")

# How long shutdown waits for woken connection threads; well inside the 5 s service managers allow.
REPLY_GRACE_S = 1.0  # seconds a reply in flight at a stop has to go out
CONN_JOIN_SECONDS = 2.5


class MetricsPort:
    """The Prometheus registry served on 127.0.0.1 (off without --metrics-port); `on_start` runs
    once the port listens (it sets the gauges that are computed, not counted)."""

    def __init__(self, port: int | None, on_start: Callable[[], Any]):
        self.port = port
        self.on_start = on_start
        self._server: Any = None

    def start(self) -> None:
        if self.port is None:
            return
        from prometheus_client import start_http_server

        try:
            server, _ = start_http_server(self.port, addr="127.0.0.1", registry=metrics.REGISTRY)
        except OSError as e:
            raise KVStoreError(
                f"--metrics-port {self.port}: cannot listen on 127.0.0.1: {e}"
            ) from None
        self._server = server
        self.on_start()
        log.info("metrics on http://127.0.0.1:%d/metrics", server.server_port)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class Daemon:
    """The daemon process: it holds its parts (store, writer, upkeep, ledger, learning, the
    commands over them, the metrics port) and is their DaemonControl (kvstore.daemon.commands).
    """

    def __init__(
        self,
        home: Path,
        *,
        store: Store,
        settings: Settings,
        manifests: list[Path],
        listener: socket.socket,
        socket_path: Path,
        fixed_manifests: tuple[Path, ...] = (),
        metrics_port: int | None = None,
    ):
        self.home = home
        self.store = store
        self.settings = settings
        self.manifests = manifests
        # The --manifest (or the home's manifest.toml) it was started with: not the registry's
        # to forget.
        self.fixed_manifests = frozenset(canonical(p) for p in fixed_manifests)
        self.listener = listener
        self.socket_path = socket_path
        self.started = time.time()
        self.stopping = threading.Event()
        self.stop_reason = ""
        self.writer = Writer()
        store.on_damage.append(self._store_damaged)
        self.upkeep = Upkeep(store, home, settings, self.stopping)
        # Clock-bound pins (a template that prints the date) are re-warmed across midnight.
        self.daywatch = DayWatch(self.upkeep, lambda: list(self.manifests), self.writer.submit)
        self.ledger = Ledger(home)
        self.learning = Learning(
            store,
            self.upkeep.blocks,
            self.ledger,
            settings,
            lambda name, fn: self.writer.submit(name, fn, reported=True).result(),
            budget=self.upkeep.budget,
            uploader=lambda: self.upkeep.uploader,
        )
        self.commands = Commands(
            store, self.writer, self.upkeep, self.ledger, self.learning, settings, control=self
        )
        self.metrics = MetricsPort(
            metrics_port, lambda: self.learning.learned_stats(store.metas(errors=[]))
        )
        self.watcher: Any = None
        self._watcher_lock = threading.Lock()
        self._layout = cred_layout()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._conns_lock = threading.Lock()
        self._pending: Future | None = None
        self._retry: Future | None = None  # a deferred warm retried (memory allowed it)
        self._pending_lock = threading.Lock()
        self._hup = False
        self._wake_r, self._wake_w = socket.socketpair()

    # -- control ------------------------------------------------------------------------------

    def request_stop(self, reason: str) -> None:
        if not self.stopping.is_set():
            self.stop_reason = reason
            self.stopping.set()
        self._wake()

    def _store_damaged(self, e: StoreDamaged) -> None:
        """The first transaction that met a damaged store file: say it in one line and stop,
        exiting as a start on that file would (exits.STORE_DAMAGED), socket removed."""
        log.error("%s; stopping (exit %d)", e, exits.STORE_DAMAGED)
        self.request_stop("store_damaged")

    def reload(self, cause: str, *, settings: bool = True) -> Future:
        """Queue a reconcile of every manifest; one already queued and not started absorbs this."""
        if settings:
            try:
                self.settings = load_settings(self.home)
            except KVStoreError as e:
                log.error("reload: %s (keeping the previous settings)", e)
            # one frozen value, replaced whole: each part that reads it is handed the new one
            self.upkeep.settings = self.upkeep.budget.settings = self.settings
            self.learning.settings = self.commands.settings = self.settings
        with self._pending_lock:
            pending = self._pending
            if pending is not None and not pending.running() and not pending.done():
                return pending
            self._pending = self.writer.submit(
                "reconcile", lambda: self.upkeep.reconcile(list(self.manifests), cause=cause)
            )
            return self._pending

    def watcher_mode(self) -> str:
        return getattr(self.watcher, "mode", "off")

    def _on_files_changed(self, changed: set[Path]) -> None:
        names = ", ".join(sorted(str(p) for p in changed)[:5])
        log.info("files changed (%s%s): reconciling", names, ", ..." if len(changed) > 5 else "")
        self.reload(f"files changed: {names}", settings=False)

    def watch(self, manifest: Path) -> None:
        """Watch one more manifest from now on (a warm request named it). The running watcher
        re-lists its files: the files it already watches keep their baseline, so an edit it has
        not checked yet is still reported, and nothing already watched is re-hashed."""
        with self._watcher_lock:  # two warm requests for one new manifest: one append
            if canonical(manifest) in {canonical(p) for p in self.manifests}:
                return
            self.manifests.append(manifest)
            log.info("now watching manifest %s", manifest)
            if self.watcher is not None and not self.stopping.is_set():
                self.watcher.refresh()

    def unwatch(self, manifest: Path) -> bool:
        """Stop watching one manifest (named by any path to it); False when it was not."""
        target = canonical(manifest)
        with self._watcher_lock:
            kept = [p for p in self.manifests if canonical(p) != target]
            if len(kept) == len(self.manifests):
                return False
            self.manifests[:] = kept
            log.info("no longer watching manifest %s", target)
            if self.watcher is not None and not self.stopping.is_set():
                self.watcher.refresh()
            return True

    def _start_watcher(self) -> None:
        try:
            from kvstore.daemon.watcher import Watcher
        except ImportError as e:  # pragma: no cover - only while the watcher is being written
            log.warning("file watching unavailable (%s); SIGHUP or `kvstore warm` re-reads", e)
            return
        self.watcher = Watcher(
            lambda: watched_files(list(self.manifests)),
            self._on_files_changed,
            debounce=float(self.settings.debounce),
            poll_interval=float(self.settings.poll_interval),
            keep_out=[self.home / STORE_DIR],  # no schedule may see LMDB's writes
        )
        self.watcher.start()

    # -- serving ------------------------------------------------------------------------------

    def serve(self) -> int:
        """Accept on a side thread; run write jobs on this (the main) thread until stopped."""
        self._install_signals()
        log.info(
            "serving %s for home %s (pid %d, manifests: %s, rss %.0f MiB)",
            self.socket_path,
            self.home,
            os.getpid(),
            ", ".join(map(str, self.manifests)) or "none",
            rss_bytes() / 2**20,
        )
        self.metrics.start()
        # The boot warm is of the manifests this start found: a warm request that arrives first
        # adds its manifest and warms it itself (warming it here too would prefill it twice).
        booted = list(self.manifests)
        acceptor = threading.Thread(target=self._accept_loop, name="kvstore-accept")
        acceptor.start()
        try:
            self.upkeep.start_remote(self.ledger)  # before the boot warm: it may fetch
            if any(p.is_file() for p in booted):  # a missing one is warmed on arrival
                self.writer.submit("reconcile", lambda: self.upkeep.reconcile(booted, cause="boot"))
            with self._watcher_lock:
                self._start_watcher()
            log.info("watcher mode: %s", self.watcher_mode())
            self.daywatch.start()
            self.writer.run(self.stopping)
        finally:
            self.request_stop("error")  # no-op after a signal; stops the acceptor after a bug
            acceptor.join()
            self.metrics.stop()
            self._shutdown()
        if self.stop_reason == "store_damaged":
            return exits.STORE_DAMAGED
        return exits.INTERNAL if self.stop_reason == "error" else exits.OK

    def _install_signals(self) -> None:
        # Python runs handlers on the main thread, between the writer's jobs' bytecodes or while
        # it waits for the next job; the in-flight write finishes, a warm stops between pins.
        def stop(signum: int, frame: object) -> None:
            self.request_stop(signal.Signals(signum).name)

        def hup(signum: int, frame: object) -> None:
            self._hup = True
            self._wake()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGHUP, hup)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass

    def _accept_loop(self) -> None:
        """Accepts until stopping; then closes and removes the socket at once, so clients fall
        back to writing directly while the write in flight finishes."""
        interval = float(self.settings.reader_check_interval)
        next_check = time.monotonic() + interval
        memory_interval = float(self.settings.memory_check_interval)
        next_memory = time.monotonic() + memory_interval
        self.listener.setblocking(False)
        try:
            # a bug here must still stop the daemon cleanly, not hang it
            with daemon_handler("accept loop failed", logger=log) as failed:
                with selectors.DefaultSelector() as sel:
                    sel.register(self.listener, selectors.EVENT_READ)
                    sel.register(self._wake_r, selectors.EVENT_READ)
                    while not self.stopping.is_set():
                        wake_at = min(next_check, next_memory)
                        for key, _ in sel.select(timeout=max(0.0, wake_at - time.monotonic())):
                            if key.fileobj is self.listener:
                                self._accept()
                            else:
                                self._wake_r.recv(4096)
                        if self._hup:
                            self._hup = False
                            log.info("SIGHUP: re-reading settings and manifests")
                            self.reload("SIGHUP")
                        if time.monotonic() >= next_check:
                            if n := self.store.reader_check():
                                log.info(
                                    "reader_check: cleared %s", counted(n, "stale reader slot")
                                )
                            next_check = time.monotonic() + interval
                        if time.monotonic() >= next_memory:
                            self._retry_deferred()
                            next_memory = time.monotonic() + memory_interval
            if failed.error is not None:
                self.request_stop("error")
        finally:
            self.listener.close()
            try:
                self.socket_path.unlink()
            except FileNotFoundError:
                pass
            log.info("stopping (%s): socket closed and removed", self.stop_reason)

    def _retry_deferred(self) -> None:
        """A warm deferred for memory is retried once memory allows (one retry queued at a time)."""
        if self._retry is not None and not self._retry.done():
            return
        if self.upkeep.memory_allows_retry():
            self._retry = self.writer.submit(
                "warm deferred", lambda: self.upkeep.retry_deferred(list(self.manifests))
            )

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        sock.setblocking(True)
        if not check_peer(sock, self._layout):  # before reading a single byte
            log.warning("refused a connection from another user")
            sock.close()
            return
        cap = int(self.settings.max_connections)
        with self._conns_lock:
            full = len(self._conns) >= cap
            if not full:
                t = threading.Thread(
                    target=self._serve_conn, args=(sock,), daemon=True, name="kvstore-conn"
                )
                self._conns[sock] = t
        if full:
            log.warning("refused a connection: %d open, the cap is max_connections=%d", cap, cap)
            try:
                sock.settimeout(1.0)
                protocol.send(
                    sock,
                    protocol.error(f"too many connections (max_connections={cap})", ErrorCode.BUSY),
                )
            except OSError:
                pass
            sock.close()
            return
        t.start()

    def _serve_conn(self, sock: socket.socket) -> None:
        conn = Connection(sock, self.settings)
        try:
            while not self.stopping.is_set():
                try:
                    msg = conn.next_request()
                except ProtocolError as e:
                    log.warning("connection closed: %s", e)
                    try:  # the stream is out of step now: say why, then hang up
                        sock.settimeout(1.0)
                        protocol.send(sock, protocol.error(str(e), ErrorCode.PROTOCOL))
                    except OSError:
                        pass
                    return
                if msg is None:
                    return
                if msg.get("cmd") not in READS:
                    log.info("request %s", msg.get("cmd"))
                conn.reply(self.commands.dispatch(msg, conn))
                if conn.close_after_reply:
                    return
        except OSError:
            return  # the client went away mid-reply
        finally:
            sock.close()
            with self._conns_lock:
                self._conns.pop(sock, None)

    def _shutdown(self) -> None:
        """After the writer returned and the socket is gone: watcher, connections, LMDB.

        LMDB is closed only once no connection thread is left: closing it under a thread still
        inside a read would crash, not stop. Woken threads finish at once (their socket is shut
        down, the writer's queued jobs failed); one that does not within CONN_JOIN_SECONDS is
        logged and the store is left for the process exit to release."""
        deadline = time.monotonic() + CONN_JOIN_SECONDS
        with self._watcher_lock:
            if self.watcher is not None:
                self.watcher.stop()
        self.daywatch.stop()
        with self._conns_lock:
            conns = dict(self._conns)
        # First the read side only: a thread waiting for a client's next frame wakes, and a reply
        # in flight (a request the stop's cause failed: a damaged store's line) still goes out;
        # then both sides, so a client that reads no reply holds no thread.
        for how, grace in ((socket.SHUT_RD, REPLY_GRACE_S), (socket.SHUT_RDWR, CONN_JOIN_SECONDS)):
            for sock in conns:
                try:
                    sock.shutdown(how)
                except OSError:
                    pass
            for t in conns.values():
                t.join(max(0.0, min(deadline, time.monotonic() + grace) - time.monotonic()))
        stuck: list[object] = [t for t in conns.values() if t.is_alive()]  # counted, below
        if not self.upkeep.stop_remote():  # it reads the store: same rule as a connection
            stuck.append("the fleet uploader")
        if stuck:
            log.warning(
                "%s still busy after %gs; leaving the store open for the "
                "process exit to release rather than closing it under them",
                counted(len(stuck), "connection thread"),
                CONN_JOIN_SECONDS,
            )
        else:
            self.store.close()
        self._wake_r.close()
        self._wake_w.close()
        log.info("stopped")
