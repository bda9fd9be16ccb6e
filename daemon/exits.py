"""Why the daemon exits, with which status, and what launchd and systemd then do: one table.

The service files are derived from it: the plist's `KeepAlive {SuccessfulExit: false}` restarts
every non-zero exit (launchd.plist(5): "If false, the job will be restarted in the inverse
condition"), and systemd's `Restart=on-failure` restarts non-zero exits except those listed in
`RestartPreventExitStatus=` (systemd.service(5)). launchd cannot be told to spare one non-zero
status, so a condition that must not restart but must not look like success either (`config`)
does not exit under launchd: it logs once and waits for SIGTERM (`PARK_UNDER`).
"""

from __future__ import annotations

from dataclasses import dataclass

# Set in the service files' environment so the daemon knows which supervisor runs it.
SUPERVISOR_ENV = "KVSTORE_SUPERVISOR"


@dataclass(frozen=True)
class ExitRule:
    code: int | None  # None: the daemon does not exit for this condition
    when: str
    restart: bool  # whether the supervisor should start it again
    then: str  # what the user sees / should do


EXITS: dict[str, ExitRule] = {
    "stopped": ExitRule(0, "SIGTERM, SIGINT or a `shutdown` request", False, "nothing to do"),
    "lock_held": ExitRule(
        0,
        "another daemon already holds the home's lock",
        False,
        "that daemon serves the home; one line names its pid",
    ),
    "internal": ExitRule(
        70,  # EX_SOFTWARE (sysexits.h)
        "an internal failure: the accept loop or the writer died, an uncaught exception",
        True,
        "restarted after ThrottleInterval / RestartSec; the traceback is in the log",
    ),
    "transient_io": ExitRule(
        70,  # EX_SOFTWARE, as "internal": a failure worth a restart, not a refusal
        "a transient I/O error at start (ENOSPC, EDQUOT, EIO: kvstore.errors.TRANSIENT_ERRNOS), "
        "started by hand; under launchd or systemd it does not exit but tries again itself, "
        "after 2 s doubling to a minute (daemon/boot.py), and exits 0 if stopped meanwhile",
        True,
        "each try's log line names the path and the error: free space or check that disk, and "
        "the next try proceeds",
    ),
    "config": ExitRule(
        78,  # EX_CONFIG (sysexits.h)
        "configuration refused: socket directory or home unusable (permissions, not a directory), "
        "settings or store unreadable for a reason a restart does not mend",
        False,
        "fix what the one log line names, then `kvstore service install` again",
    ),
    "store_damaged": ExitRule(
        78,  # EX_CONFIG, as "config": a restart finds the same file
        "the store file is damaged: shorter than its LMDB header says (a copy or restore cut "
        "short) or no LMDB file, at start or found by the first transaction that meets the "
        "damage while serving (the socket is removed); it is kept as it is, not replaced",
        False,
        "restore data.mdb from a backup, or move it aside as the one log line says: the next "
        "start makes a fresh store and warms the manifests' pins; apps prefill as usual meanwhile",
    ),
    "manifest_missing": ExitRule(
        None,
        "the --manifest file is missing (moved, on an unmounted volume, mid-checkout)",
        False,
        "serves and watches for it; warms when it reappears; said once in the log",
    ),
}


def _status(condition: str) -> int:
    """The status the daemon exits with for `condition`, one it does exit for."""
    code = EXITS[condition].code
    if code is None:
        raise ValueError(f"the daemon does not exit for {condition!r}")
    return code


OK = 0
LOCK_HELD = _status("lock_held")
INTERNAL = _status("internal")
TRANSIENT_IO = _status("transient_io")
CONFIG = _status("config")
STORE_DAMAGED = _status("store_damaged")

# Supervisors that restart every non-zero exit, so `config` waits for SIGTERM instead of exiting.
PARK_UNDER = frozenset({"launchd"})


def restart_prevent_statuses() -> list[int]:
    """Non-zero statuses systemd must not restart (`RestartPreventExitStatus=`)."""
    return sorted({r.code for r in EXITS.values() if r.code and not r.restart})


def restarted_by_launchd(code: int) -> bool:
    """What `KeepAlive {SuccessfulExit: false}` does with an exit status."""
    return code != 0


def restarted_by_systemd(code: int) -> bool:
    """What `Restart=on-failure` with `RestartPreventExitStatus=` does with an exit status."""
    return code != 0 and code not in restart_prevent_statuses()
