"""The LaunchAgent: its plist, and installing, removing and inspecting it with `launchctl`.

Sources (checked by reading; none of this can run on Linux):
- launchd.plist(5) and launchctl's source, apple-oss-distributions/launchd (launchd-842.1.4):
  man/launchd.plist.5, support/launchctl.c, src/core.c.
- Homebrew's `brew services`, Homebrew/brew Library/Homebrew/services/{cli,formula_wrapper}.rb:
  bootout, then wait while the label is still loaded before going on; `print` parsed for
  `pid = N` and `last exit code = N`; service files chmod 0644.
"""

from __future__ import annotations

import contextlib
import os
import plistlib
import re
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import click

from kvstore.daemon import exits
from kvstore.daemon.cli.service import ServiceStatus
from kvstore.daemon.logs import CRASH_LOG_NAME

LABEL = "dev.kvstore.daemon"  # one per user: reinstalling with another home replaces it
THROTTLE_INTERVAL = 10  # s between launches of a crashing job (launchd.plist(5); also the default)
# launchd sends SIGKILL this long after SIGTERM (launchd.plist(5), default 20). The daemon stops
# within one prefill chunk plus the write in flight (docs/daemon.md, "Shutdown"), far inside this.
EXIT_TIMEOUT = 20
# `launchctl bootout` returns before the job has exited (brew services loops on it for that
# reason); a bootstrap of the label meanwhile fails with 5. Wait past ExitTimeOut for it to go.
BOOTOUT_DEADLINE = EXIT_TIMEOUT + 10
POLL_SECONDS = 0.25
# Bootstrap failures that mean "the old job is still being torn down": retried until the deadline.
# 5 EIO ("Bootstrap failed: 5: Input/output error"), 37 EALREADY ("Operation already in progress").
BOOTSTRAP_RETRY = frozenset({5, 37})
# `launchctl print` of a label not loaded: "Bad request." / 'Could not find service "L" in domain
# for user gui: 501', exit 113 (as reported from real Macs, e.g. NousResearch/hermes-agent#5536).
NOT_FOUND = 113
PLIST_MODE = 0o644  # launchctl skips group- or world-writable plists ("Dubious permissions")
LOG_NAME = "daemon.log"  # the daemon's own rotating log (--log-file, daemon/logs.py)
# ProcessType Interactive: launchd.plist(5) says an unspecified ProcessType (= Standard) gets
# "light resource limits ... throttling its CPU usage and I/O bandwidth", Interactive "none".
# The boot warm must finish before the user's apps ask for their pins, so it runs unthrottled;
# Homebrew's service DSL notes databases use Interactive for the same reason (service.rb).
PROCESS_TYPE = "Interactive"


def domain() -> str:
    return f"gui/{os.getuid()}"


def target() -> str:
    return f"{domain()}/{LABEL}"


def plist_path() -> Path:
    return Path.home() / "Library" / "LaunchAgents" / f"{LABEL}.plist"


def log_dir() -> Path:
    return Path.home() / "Library" / "Logs" / "kvstore"


def plist(argv: list[str], env: dict[str, str]) -> bytes:
    logs = log_dir()
    job = {
        "Label": LABEL,
        "ProgramArguments": [*argv, "--log-file", str(logs / LOG_NAME)],
        "EnvironmentVariables": {**env, exits.SUPERVISOR_ENV: "launchd"},
        "RunAtLoad": True,
        # Restarted after every non-zero exit, never after exit 0 (daemon/exits.py's table).
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": THROTTLE_INTERVAL,
        "ExitTimeOut": EXIT_TIMEOUT,
        "ProcessType": PROCESS_TYPE,
        # launchd opens these O_APPEND and never rotates them (core.c, job_setup_fd): only
        # crash output lands here; the daemon caps it at start and logs to LOG_NAME itself.
        "StandardOutPath": str(logs / CRASH_LOG_NAME),
        "StandardErrorPath": str(logs / CRASH_LOG_NAME),
    }
    return plistlib.dumps(job, fmt=plistlib.FMT_XML, sort_keys=False)


def write_plist(path: Path, content: bytes) -> None:
    """Atomically, mode 0644 whatever the umask: launchctl skips a plist that is group- or
    world-writable or owned by another user (support/launchctl.c, "Dubious permissions")."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with contextlib.ExitStack() as undo:  # a failed write leaves no temporary file behind
        undo.callback(Path(tmp).unlink, missing_ok=True)
        with os.fdopen(fd, "wb") as f:
            f.write(content)
            os.fchmod(f.fileno(), PLIST_MODE)
        os.replace(tmp, path)
        undo.pop_all()


# -- launchctl -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Done:
    rc: int
    out: str
    err: str

    def line(self) -> str:
        text = (self.err or self.out).strip()
        return text.splitlines()[0] if text else ""


def launchctl(*args: str) -> Done:
    p = subprocess.run(["launchctl", *args], capture_output=True, text=True, timeout=30)
    return Done(p.returncode, p.stdout, p.stderr)


def wait_until(cond: Callable[[], bool], deadline: float) -> bool:
    while not cond():
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_SECONDS)
    return True


def loaded() -> bool:
    return launchctl("print", target()).rc == 0


def bootout_and_wait() -> None:
    """Unload the label and wait until launchd has forgotten it (its job exited)."""
    done = launchctl("bootout", target())
    if done.rc not in (0, 3, 36, NOT_FOUND):  # 3 ESRCH: not loaded; 36 EINPROGRESS: stopping
        click.echo(f"launchctl bootout: {done.line()} (exit {done.rc}); waiting anyway", err=True)
    if not wait_until(lambda: not loaded(), time.monotonic() + BOOTOUT_DEADLINE):
        raise click.ClickException(
            f"{target()} is still loaded {BOOTOUT_DEADLINE}s after `launchctl bootout`; "
            f"stop it with `launchctl kill SIGKILL {target()}` and install again"
        )


def bootstrap(path: Path) -> None:
    """`launchctl bootstrap`, retried while it fails with 5 or 37 (the label still going away)."""
    deadline = time.monotonic() + BOOTOUT_DEADLINE
    while True:
        done = launchctl("bootstrap", domain(), str(path))
        if done.rc == 0:
            return
        if done.rc not in BOOTSTRAP_RETRY or time.monotonic() >= deadline:
            raise click.ClickException(
                f"`launchctl bootstrap {domain()} {path}` failed: {done.line()} (exit {done.rc}); "
                f"`launchctl print {target()}` and {log_dir() / CRASH_LOG_NAME} may say why"
            )
        time.sleep(POLL_SECONDS)


def install(content: bytes) -> Path:
    """Replace whatever runs under LABEL with this plist, and start it."""
    path = plist_path()
    log_dir().mkdir(parents=True, exist_ok=True)  # launchd does not create it
    bootout_and_wait()  # before writing: a reinstall must not leave the old job running
    write_plist(path, content)
    done = launchctl("enable", target())  # undo an earlier `launchctl disable`
    if done.rc:
        raise click.ClickException(f"`launchctl enable {target()}` failed: {done.line()}")
    bootstrap(path)
    return path


def uninstall() -> Path:
    path = plist_path()
    bootout_and_wait()
    path.unlink(missing_ok=True)
    return path


def dry_run_install() -> list[str]:
    return [
        f"launchctl bootout {target()}",
        f"wait until `launchctl print {target()}` fails (up to {BOOTOUT_DEADLINE}s)",
        f"write {plist_path()} (mode {PLIST_MODE:o})",
        f"launchctl enable {target()}",
        f"launchctl bootstrap {domain()} {plist_path()}  (retried on exit 5 or 37)",
    ]


def dry_run_uninstall() -> list[str]:
    return [
        f"launchctl bootout {target()}",
        f"wait until `launchctl print {target()}` fails (up to {BOOTOUT_DEADLINE}s)",
        f"remove {plist_path()}",
    ]


# -- status ----------------------------------------------------------------------------------

# `launchctl print` output "is NOT API in any sense at all" (launchctl(1), quoted in
# Homebrew/brew#19602); these are the fields brew services parses too (formula_wrapper.rb:
# /pid = ([0-9]+)/, /last exit code = ([0-9]+)/), and status shows them only as information.
_FIELDS = {
    "pid": re.compile(r"^\s*pid = (\d+)", re.M),
    "state": re.compile(r"^\s*state = (.+)$", re.M),
    "last_exit": re.compile(r"^\s*last exit code = (\d+)", re.M),
}


def parse_print(text: str) -> dict[str, str]:
    return {k: m.group(1).strip() for k, rx in _FIELDS.items() if (m := rx.search(text))}


def status() -> ServiceStatus:
    done = launchctl("print", target())
    info: ServiceStatus = {"manager": f"launchd {target()}", "loaded": done.rc == 0}
    if done.rc == 0:
        fields = parse_print(done.out)
        info["state"] = fields.get("state")
        info["pid"] = int(fields["pid"]) if "pid" in fields else None
        info["last_exit"] = int(fields["last_exit"]) if "last_exit" in fields else None
    elif done.rc != NOT_FOUND:
        info["error"] = done.line()
    info["logs"] = [log_dir() / LOG_NAME, log_dir() / CRASH_LOG_NAME]
    return info
