"""When mlx or mlx-lm is upgraded: check the stored KV, and run the new code.

A running process keeps the code it imported, so the daemon's own prefills would still be the old
code's after an upgrade under it. The version watch reads the installed dist metadata fresh (what
an upgrade rewrites) every `version_check_interval` seconds; when it changed since this process
started, the daemon stops and re-executes itself (same pid, what launchd and systemd see) into the
new code. At boot the versions it runs are compared with those its home last ran with
(HOME/runtime.json); when they differ, one short pin per model is re-prefilled and compared with
its stored entry (kvstore.warm.canary), and a model whose KV moved beyond float noise has its
entries evicted (kvstore.ops.evict), so the boot warm that follows re-warms its pins with the new
code.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from kvstore.errors import KVStoreError, counted
from kvstore.identity import codehash
from kvstore.ops.evict import evict, upgrade_canary
from kvstore.pins.manifest import load_manifest
from kvstore.store.keys import fingerprint_of
from kvstore.store.store import Store
from kvstore.warm import canary

log = logging.getLogger("kvstore.daemon")

restart = threading.Event()  # set when the daemon stops to re-execute into upgraded code
# The installed versions when the daemon's code was imported: what it runs.
INSTALLED_AT_START = codehash.installed_versions()


def check_at_boot(store: Store, home: Path, manifest_paths: list[Path]) -> list:
    """The canary, when the versions this daemon runs are not those its home last ran with.
    Returns the results (empty when nothing needed checking)."""
    running = codehash.runtime_versions()
    before = canary.stored_versions(home)
    if before == running:
        return []
    results = []
    if before is not None:
        log.info(
            "upgrade canary: mlx %s, mlx-lm %s since the last run (was mlx %s, mlx-lm %s): "
            "re-prefilling one short pin per model",
            running["mlx"], running["mlx_lm"], before.get("mlx"), before.get("mlx_lm"),
        )  # fmt: skip
        for path in manifest_paths:
            try:
                manifest = load_manifest(path)
            except KVStoreError as e:
                log.error("upgrade canary: %s (not checked)", e)
                continue
            for result in canary.check_manifest(manifest, store, home=home):
                results.append(result)
                if result.ok or result.error:
                    log.log(logging.ERROR if result.error else logging.INFO, "upgrade canary: %s",
                            canary.describe(result))  # fmt: skip
                    continue
                fingerprint = fingerprint_of(bytes.fromhex(result.key))
                stale = store.metas(fingerprint, errors=[])
                versions = f"mlx {running['mlx']} / mlx-lm {running['mlx_lm']}"
                evict(home, upgrade_canary(versions), store=store, entries=stale)
                log.warning("upgrade canary: %s; dropped the model's %s so they are re-warmed "
                            "with %s", canary.describe(result), counted(len(stale), "entry"),
                            versions)  # fmt: skip
    canary.save_versions(home, running)
    return results


class VersionWatch:
    """Reads the installed versions every `interval` seconds on a side thread (metadata only, no
    mlx); on a change since start, `on_upgrade` is called once."""

    def __init__(
        self, interval: float, stopping: threading.Event, on_upgrade: Callable[[str], None]
    ):
        self.interval = interval
        self.stopping = stopping
        self.on_upgrade = on_upgrade
        self.baseline = INSTALLED_AT_START
        self._thread = threading.Thread(target=self._run, name="kvstore-versions", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self.stopping.wait(self.interval):
            now = codehash.installed_versions()
            if now != self.baseline:
                self.on_upgrade(
                    ", ".join(
                        f"{k} {self.baseline.get(k)} -> {v}"
                        for k, v in now.items()
                        if self.baseline.get(k) != v
                    )
                )
                return


def restart_into_new_code(what: str) -> None:
    """Stop the daemon (as SIGTERM does: the write in flight finishes) to re-execute it."""
    log.warning(
        "upgrade canary: %s installed under the running daemon; restarting into the new code "
        "(this process still runs the old one, and its KV would be filed as the new one's)",
        what,
    )
    restart.set()
    os.kill(os.getpid(), signal.SIGTERM)


def reexec(argv: list[str]) -> None:
    """Replace this process with `python -m kvstore daemon ...` (the lock, socket and LMDB
    were released by the clean stop; the pid stays, so a service manager sees no exit)."""
    log.info("upgrade canary: re-executing %s", " ".join(argv))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "kvstore", *argv])
