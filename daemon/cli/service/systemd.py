"""The systemd user unit: its text, and installing, removing and inspecting it with systemctl."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import click

from kvstore.daemon import exits
from kvstore.daemon.cli.service import ServiceStatus

UNIT_NAME = "kvstore.service"
SYSTEMCTL = ["systemctl", "--user"]
# Properties `service status` reads with `systemctl show -p` (org.freedesktop.systemd1(5)).
SHOW = ("LoadState", "ActiveState", "SubState", "MainPID", "ExecMainStatus", "FragmentPath")


def unit_path() -> Path:
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "systemd" / "user" / UNIT_NAME


def _escape(text: str) -> str:
    # Inside double quotes systemd honours C escapes; `%` specifiers expand even there.
    for raw, esc in (("\\", "\\\\"), ('"', '\\"'), ("\n", "\\n"), ("\t", "\\t"), ("%", "%%")):
        text = text.replace(raw, esc)
    return text


def quote(arg: str) -> str:
    """One ExecStart= word: double-quoted, with `$` doubled so it is not an env reference."""
    return '"' + _escape(arg).replace("$", "$$") + '"'


def unit(argv: list[str], env: dict[str, str], home: Path) -> str:
    env = {**env, exits.SUPERVISOR_ENV: "systemd"}
    env_lines = "\n".join(f'Environment="{_escape(f"{k}={v}")}"' for k, v in env.items())
    prevent = " ".join(map(str, exits.restart_prevent_statuses()))
    # No After=default.target: the target pulls us in (WantedBy) and is ordered after what it
    # wants, so ordering us after it would be a cycle.
    # Description= is specifier-expanded but not unquoted or unescaped.
    where = str(home).replace("%", "%%").replace("\n", " ")
    return f"""\
[Unit]
Description=kvstore daemon, prefix KV caches for mlx-lm (home {where})

[Service]
Type=simple
ExecStart={" ".join(quote(a) for a in argv)}
{env_lines}
# Non-zero exits restart, except the permanent ones of daemon/exits.py.
Restart=on-failure
RestartPreventExitStatus={prevent}
RestartSec=2
TimeoutStopSec=20
KillSignal=SIGTERM

[Install]
WantedBy=default.target
"""


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run([*SYSTEMCTL, *args], capture_output=True, text=True, timeout=60)
    if check and p.returncode:
        line = (p.stderr or p.stdout).strip().splitlines()[:1]
        raise click.ClickException(
            f"`systemctl --user {' '.join(args)}` failed with exit status {p.returncode}"
            + (f": {line[0]}" if line else "")
        )
    return p


def install(content: str) -> Path:
    path = unit_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    os.chmod(path, 0o644)
    _run("daemon-reload")
    _run("try-restart", UNIT_NAME)  # reinstall: a running one takes the new arguments
    _run("enable", "--now", UNIT_NAME)
    return path


def uninstall() -> Path:
    path = unit_path()
    _run("disable", "--now", UNIT_NAME, check=False)
    path.unlink(missing_ok=True)
    _run("daemon-reload", check=False)
    return path


def dry_run_install() -> list[str]:
    return [
        f"write {unit_path()} (mode 644)",
        "systemctl --user daemon-reload",
        f"systemctl --user try-restart {UNIT_NAME}",
        f"systemctl --user enable --now {UNIT_NAME}",
    ]


def dry_run_uninstall() -> list[str]:
    return [
        f"systemctl --user disable --now {UNIT_NAME}",
        f"remove {unit_path()}",
        "systemctl --user daemon-reload",
    ]


def parse_show(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def status() -> ServiceStatus:
    p = _run("show", "-p", ",".join(SHOW), UNIT_NAME, check=False)
    props = parse_show(p.stdout) if p.returncode == 0 else {}
    info: ServiceStatus = {
        "manager": f"systemd --user {UNIT_NAME}",
        "loaded": props.get("LoadState") == "loaded",
        "state": f"{props.get('ActiveState', '?')} ({props.get('SubState', '?')})",
    }
    if p.returncode:
        info["error"] = (p.stderr or p.stdout).strip()
    pid = props.get("MainPID", "0")
    info["pid"] = int(pid) if pid.isdigit() and int(pid) > 0 else None
    code = props.get("ExecMainStatus", "")
    info["last_exit"] = int(code) if code.isdigit() else None
    info["journal"] = journal_tail()
    return info


def journal_tail(lines: int = 10) -> list[str] | None:
    """The unit's last journal lines (journald rotates them), or None without journalctl."""
    if shutil.which("journalctl") is None:
        return None
    p = subprocess.run(
        ["journalctl", "--user", "-u", UNIT_NAME, "-n", str(lines), "--no-pager", "-o", "cat"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return p.stdout.splitlines() if p.returncode == 0 else None
