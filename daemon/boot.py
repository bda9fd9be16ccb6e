"""Boot the daemon and map every way it ends to an exit status (daemon/exits.py's table).

Order matters: the lock first (a second daemon exits 0 without touching the home), then settings,
store and socket; a refusal there is a configuration error (78), a failure once serving is an
internal one (70).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from daemon import exits
from daemon.lifecycle import DaemonRunning, acquire_lock, bind_socket, park_if_supervised
from daemon.server import Daemon, registered_manifests
from kvstore.errors import KVStoreError
from kvstore.settings import MANIFEST_NAME, ensure_home, load_settings
from kvstore.store import Store

log = logging.getLogger("kvstore.daemon")


def run(home: Path, *, manifest: Path | None = None) -> int:
    """Run the daemon for `home` until SIGTERM, SIGINT or a shutdown request. The exit status
    per condition, and what the supervisor then does, is daemon/exits.py's table."""
    try:
        booted = _boot(home, manifest)
    except (KVStoreError, OSError) as e:  # the home, socket, settings or store refused
        log.error("cannot start: %s", e)
        return park_if_supervised(exits.CONFIG, str(e))
    except Exception:
        log.exception("internal failure while starting")
        return exits.INTERNAL
    if isinstance(booted, int):
        return booted
    daemon, lock_fd = booted
    try:
        return daemon.serve()
    except Exception:
        log.exception("internal failure")
        return exits.INTERNAL
    finally:
        os.close(lock_fd)


def _boot(home: Path, manifest: Path | None) -> tuple[Daemon, int] | int:
    """Take the lock, open the store, bind the socket: a Daemon ready to serve and the lock's
    fd, or the exit status when another daemon holds the lock."""
    home = ensure_home(home.expanduser().absolute())
    try:
        lock_fd = acquire_lock(home)  # before anything else touches the home
    except DaemonRunning as e:
        log.error("%s; this one exits 0 so that no supervisor restarts it", e)
        return exits.LOCK_HELD
    try:
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
        store = Store(  # opening it runs reader_check
            home, map_size=int(settings["map_size"]), max_map_size=int(settings["max_map_size"])
        )
        try:
            listener, path = bind_socket(home, backlog=int(settings["max_connections"]))
        except BaseException:
            store.close()
            raise
        daemon = Daemon(
            home,
            store=store,
            settings=settings,
            manifests=manifests,
            listener=listener,
            socket_path=path,
            fixed_manifests=fixed,
        )
    except BaseException:
        os.close(lock_fd)
        raise
    return daemon, lock_fd
