"""`kvstore service`: the daemon as a launchd LaunchAgent (macOS) or a systemd user unit (Linux)."""

from __future__ import annotations

from pathlib import Path
from typing import TypedDict


class _Loaded(TypedDict):
    manager: str  # the supervisor and the job it runs, as `service status` names them
    loaded: bool


class ServiceStatus(_Loaded, total=False):
    """What `launchd.status()` / `systemd.status()` read, for `kvstore service status`."""

    state: str | None
    error: str  # the supervisor's complaint, when it could not be asked
    pid: int | None  # None: not running
    last_exit: int | None  # None: none yet
    logs: list[Path]  # launchd: the files its stdout / stderr go to
    journal: list[str] | None  # systemd: the journal's last lines (None: no journalctl)
