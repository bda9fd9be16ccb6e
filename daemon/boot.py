"""Boot the daemon and map every way it ends to an exit status (daemon/exits.py's table).

Order matters: the lock first (a second daemon exits 0 without touching the home), then settings,
store and socket; a refusal there is a configuration error (78), except a transient I/O error (a
full disk, EIO: kvstore.errors.transient) which time may mend; a failure once serving is an
internal one (70).

A transient error at start is waited out here, under a supervisor: the daemon tries again after
2 s, doubling to at most a minute, one log line a try, and exits 0 on SIGTERM meanwhile. Left to
the supervisor, a full disk would start it every few seconds for as long as the disk stays full:
launchd's ThrottleInterval is a fixed spacing between launches, with no backoff (launchd.plist(5)),
and systemd's RestartSec= is too, unless RestartSteps= and RestartMaxDelaySec= (systemd.service(5),
"Added in version 254") grow it, which older systemd (Ubuntu 22.04 has 249, Debian 12 252)
ignores. Started by hand, it exits 70 at once with the one line.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from kvstore.daemon import exits
from kvstore.daemon.lifecycle import (
    DaemonRunning,
    acquire_lock,
    bind_socket,
    park_if_supervised,
    remove_stale_socket,
    stopped,
    supervisor,
)
from kvstore.daemon.server import Daemon
from kvstore.degrade import daemon_handler
from kvstore.errors import KVStoreError, StoreDamaged, transient
from kvstore.home.registry import canonical, registered
from kvstore.home.settings import MANIFEST_NAME, ensure_home, load_settings
from kvstore.store.store import Store

log = logging.getLogger("kvstore.daemon")

RETRY_FIRST_S = 2.0  # seconds before the first try again after a transient I/O error at start
RETRY_MAX_S = 60.0  # seconds between tries at most (the wait doubles up to it)

Booted = tuple[Daemon, int] | int  # a daemon ready to serve and its lock's fd, or a status


def run(home: Path, *, manifest: Path | None = None, metrics_port: int | None = None) -> int:
    """Run the daemon for `home` until SIGTERM, SIGINT or a shutdown request. The exit status
    per condition, and what the supervisor then does, is daemon/exits.py's table."""
    booted = _start(home, manifest)
    if isinstance(booted, int):
        return booted
    daemon, lock_fd = booted
    daemon.metrics.port = metrics_port  # served from serve(); off when None
    code = exits.INTERNAL
    try:
        with daemon_handler("internal failure", logger=log):
            code = daemon.serve()
    finally:
        os.close(lock_fd)
    if code == exits.STORE_DAMAGED:  # as a start on that file would: not restarted
        return park_if_supervised(code, str(daemon.store.damage))
    return code


def _start(home: Path, manifest: Path | None) -> Booted:
    """`_boot`, tried again with backoff while a transient I/O error refuses it under a
    supervisor; every other way it fails mapped to its exit status."""
    delay = RETRY_FIRST_S
    while True:
        with daemon_handler("internal failure while starting", logger=log) as failed:
            try:
                return _boot(home, manifest)
            except (KVStoreError, OSError) as e:  # the home, socket, settings or store refused
                if not transient(e):
                    log.error("cannot start: %s", e)
                    return park_if_supervised(exits.CONFIG, str(e))
                if not supervisor():  # by hand: say it and exit, restartable
                    log.error("cannot start (a transient I/O error; exits %d to be restarted): %s",
                              exits.TRANSIENT_IO, e)  # fmt: skip
                    return exits.TRANSIENT_IO
                log.error("cannot start (a transient I/O error): %s; trying again in %.0f s",
                          e, delay)  # fmt: skip
        if failed.error is not None:
            return exits.INTERNAL
        if stopped(delay):
            log.info("stopped while waiting to start")
            return exits.OK
        delay = min(delay * 2, RETRY_MAX_S)


def _boot(home: Path, manifest: Path | None) -> Booted:
    """Take the lock, open the store, bind the socket: a Daemon ready to serve and the lock's
    fd, or the exit status when another daemon holds the lock."""
    home = ensure_home(home.expanduser().absolute())
    try:
        lock_fd = acquire_lock(home)  # before anything else touches the home
    except DaemonRunning as e:
        log.error("%s; this one exits 0 so that no supervisor restarts it", e)
        return exits.LOCK_HELD
    with contextlib.ExitStack() as undo:  # what a failed start took is given back
        undo.callback(os.close, lock_fd)
        if manifest is not None:
            manifest = manifest.expanduser().absolute()
            if not manifest.is_file():
                log.warning(
                    "%s: manifest file not found; serving, and warming it when it reappears",
                    manifest,
                )
            manifests = [manifest]
        else:
            default = home / MANIFEST_NAME
            manifests = [default] if default.is_file() else []
        fixed = tuple(manifests)
        manifests += registered_manifests(home, manifests)
        settings = load_settings(home)
        try:
            store = Store(  # opening it runs reader_check
                home, map_size=int(settings.map_size), max_map_size=int(settings.max_map_size)
            )
        except StoreDamaged:  # a daemon that died of it (a SIGBUS) may have left its socket
            remove_stale_socket(home)
            raise
        undo.callback(store.close)
        listener, path = bind_socket(home, backlog=int(settings.max_connections))
        daemon = Daemon(
            home,
            store=store,
            settings=settings,
            manifests=manifests,
            listener=listener,
            socket_path=path,
            fixed_manifests=fixed,
        )
        undo.pop_all()
    return daemon, lock_fd


def registered_manifests(home: Path, already: list[Path]) -> list[Path]:
    """The manifests registered in the home (kvstore.home.registry) not among `already`. One that is
    gone is logged and still watched, so it is reconciled when it comes back; a damaged registry
    is logged: neither stops the daemon."""
    try:
        entries = registered(home)
    except KVStoreError as e:
        log.error("%s (starting without the registered manifests)", e)
        return []
    have = {canonical(p) for p in already}
    out = []
    for r in entries:
        if r.path in have:
            continue
        have.add(r.path)
        if not r.present:
            log.warning(
                "registered manifest %s is gone; watching for it to come back "
                "(`kvstore manifests remove %s` forgets it)",
                r.path,
                r.path,
            )
        out.append(r.path)
    return out
