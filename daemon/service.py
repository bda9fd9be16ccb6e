"""Run the daemon as a service: a launchd LaunchAgent on macOS, a systemd user unit on Linux.

`kvstore service print --launchd|--systemd` renders either file on any OS; `install`, `uninstall`
and `status` act on this OS's kind, and `--dry-run` shows the file path and commands instead.
"""

from __future__ import annotations

import os
import plistlib
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import click

from kvstore.cli import home_option

LABEL = "dev.kvstore.daemon"  # one per user: reinstalling with another home replaces it
UNIT_NAME = "kvstore.service"
KINDS = ("launchd", "systemd")
# Installer variables the daemon needs to find the same models (launchd and systemd start
# services with a minimal environment).
PASS_THROUGH_ENV = ("HF_HOME", "HF_HUB_CACHE")


@dataclass(frozen=True)
class ServiceSpec:
    """What the service runs: `argv` plus its environment."""

    argv: list[str]
    home: Path
    env: dict[str, str] = field(default_factory=dict)


def kvstore_program() -> list[str]:
    """The absolute command that runs this installation's CLI: the venv's `kvstore` script next
    to this interpreter, else the one on PATH, else `python -m kvstore.cli`."""
    sibling = Path(os.path.abspath(sys.executable)).parent / "kvstore"
    if sibling.is_file() and os.access(sibling, os.X_OK):
        return [str(sibling)]
    if found := shutil.which("kvstore"):
        return [os.path.abspath(found)]
    return [os.path.abspath(sys.executable), "-m", "kvstore.cli"]


def service_spec(home: Path, manifest: Path | None = None) -> ServiceSpec:
    # Absolute paths: services start in / (launchd) or the user's home (systemd).
    home = Path(os.path.abspath(home))
    argv = [*kvstore_program(), "daemon", "--home", str(home)]
    if manifest is not None:
        argv += ["--manifest", os.path.abspath(manifest)]
    env = {"KVSTORE_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    env.update({k: os.environ[k] for k in PASS_THROUGH_ENV if os.environ.get(k)})
    return ServiceSpec(argv=argv, home=home, env=env)


# -- launchd ---------------------------------------------------------------------------------


def launchd_path() -> Path:
    return Path.home() / "Library" / "LaunchAgents" / f"{LABEL}.plist"


def launchd_log_dir() -> Path:
    return Path.home() / "Library" / "Logs" / "kvstore"


def launchd_plist(spec: ServiceSpec) -> bytes:
    logs = launchd_log_dir()
    job = {
        "Label": LABEL,
        "ProgramArguments": spec.argv,
        "EnvironmentVariables": spec.env,
        "RunAtLoad": True,
        # Restart after a crash, not after a clean SIGTERM exit (what `bootout` sends).
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": 10,  # seconds between restarts of a crashing daemon
        "ExitTimeOut": 10,  # seconds from SIGTERM to SIGKILL; the daemon exits within 5
        # Standard, not Background: Background throttles I/O and keeps the job on efficiency
        # cores, which stretches a warm (prefill + LMDB fsync) long enough that freshly
        # restarted apps miss their pins. Not Interactive: re-warms need not beat the user's apps.
        # Adaptive needs XPC transactions, which a unix-socket daemon never opens.
        "ProcessType": "Standard",
        "StandardOutPath": str(logs / "daemon.log"),
        "StandardErrorPath": str(logs / "daemon.log"),
    }
    return plistlib.dumps(job, fmt=plistlib.FMT_XML, sort_keys=False)


# -- systemd ---------------------------------------------------------------------------------


def systemd_path() -> Path:
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "systemd" / "user" / UNIT_NAME


def _systemd_escape(text: str) -> str:
    # Inside double quotes systemd honours C escapes; `%` specifiers expand even there.
    for raw, esc in (("\\", "\\\\"), ('"', '\\"'), ("\n", "\\n"), ("\t", "\\t"), ("%", "%%")):
        text = text.replace(raw, esc)
    return text


def systemd_quote(arg: str) -> str:
    """One ExecStart= word: double-quoted, with `$` doubled so it is not an env reference."""
    return '"' + _systemd_escape(arg).replace("$", "$$") + '"'


def systemd_unit(spec: ServiceSpec) -> str:
    env = "\n".join(f'Environment="{_systemd_escape(f"{k}={v}")}"' for k, v in spec.env.items())
    # No After=default.target: the target pulls us in (WantedBy) and is ordered after what it
    # wants, so ordering us after it would be a cycle.
    # Description= is specifier-expanded but not unquoted or unescaped.
    home = str(spec.home).replace("%", "%%").replace("\n", " ")
    return f"""\
[Unit]
Description=kvstore daemon, prefix KV caches for mlx-lm (home {home})

[Service]
Type=simple
ExecStart={" ".join(systemd_quote(a) for a in spec.argv)}
{env}
Restart=on-failure
RestartSec=2
TimeoutStopSec=10
KillSignal=SIGTERM

[Install]
WantedBy=default.target
"""


# -- plans: the file and the commands of each action ---------------------------------------


@dataclass(frozen=True)
class Step:
    argv: list[str]
    check: bool = True  # False: failure is expected at times (e.g. stopping what is not loaded)


@dataclass(frozen=True)
class Plan:
    kind: str
    action: str  # install: write `content` then run; uninstall: run then remove; status: run
    path: Path
    steps: list[Step]
    content: bytes | None = None


def host_kind() -> str:
    if sys.platform == "darwin":
        return "launchd"
    if sys.platform.startswith("linux"):
        return "systemd"
    raise click.ClickException(
        f"kvstore service supports macOS (launchd) and Linux (systemd), not {sys.platform}; "
        "run `kvstore daemon` under your own supervisor"
    )


def plan(kind: str, action: str, spec: ServiceSpec | None = None) -> Plan:
    if kind == "launchd":
        domain = f"gui/{os.getuid()}"
        target, path = f"{domain}/{LABEL}", launchd_path()
        if action == "install":
            assert spec is not None
            return Plan(kind, action, path, [
                Step(["launchctl", "bootout", target], check=False),  # reinstall: unload the old
                Step(["launchctl", "enable", target]),  # undo an earlier `launchctl disable`
                Step(["launchctl", "bootstrap", domain, str(path)]),
            ], launchd_plist(spec))  # fmt: skip
        if action == "uninstall":
            return Plan(kind, action, path, [Step(["launchctl", "bootout", target], check=False)])
        return Plan(kind, action, path, [Step(["launchctl", "print", target], check=False)])
    ctl = ["systemctl", "--user"]
    path = systemd_path()
    if action == "install":
        assert spec is not None
        return Plan(kind, action, path, [
            Step([*ctl, "daemon-reload"]),
            Step([*ctl, "try-restart", UNIT_NAME]),  # reinstall: a running one takes new args
            Step([*ctl, "enable", "--now", UNIT_NAME]),
        ], systemd_unit(spec).encode())  # fmt: skip
    if action == "uninstall":
        return Plan(kind, action, path, [
            Step([*ctl, "disable", "--now", UNIT_NAME], check=False),
            Step([*ctl, "daemon-reload"], check=False),
        ])  # fmt: skip
    return Plan(kind, action, path, [Step([*ctl, "--no-pager", "status", UNIT_NAME], check=False)])


def _by_hand(home: Path | None) -> str:
    where = f" --home {shlex.quote(str(home))}" if home else ""
    return f"run `kvstore daemon{where}` by hand (or under your own supervisor) instead"


def require_service_manager(kind: str, home: Path | None = None) -> None:
    """Fail with one line when launchctl / the systemd user manager cannot be reached."""
    tool, probe = (
        ("launchctl", ["launchctl", "print", f"gui/{os.getuid()}"])
        if kind == "launchd"
        else ("systemctl", ["systemctl", "--user", "show-environment"])
    )
    if shutil.which(tool) is None:
        raise click.ClickException(f"{tool} not found; {_by_hand(home)}")
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=10)
        reason = (done.stderr or done.stdout).strip().splitlines()[:1] if done.returncode else None
    except (OSError, subprocess.TimeoutExpired) as e:
        reason = [str(e)]
    if reason is not None:
        what = "no launchd GUI session" if kind == "launchd" else "no systemd user manager"
        detail = f" ({reason[0]})" if reason else ""
        raise click.ClickException(f"{what} reachable{detail}; {_by_hand(home)}")


def execute(p: Plan, *, dry_run: bool) -> int:
    """Write or remove the file and run the steps; returns the last step's exit status."""
    if dry_run:
        verb = {"install": "write", "uninstall": "remove"}.get(p.action, "read")
        click.echo(f"would {verb} {p.path}")
        for s in p.steps:
            click.echo(shlex.join(s.argv))
        return 0
    if p.content is not None:
        p.path.parent.mkdir(parents=True, exist_ok=True)
        if p.kind == "launchd":
            launchd_log_dir().mkdir(parents=True, exist_ok=True)  # launchd does not create it
        p.path.write_bytes(p.content)
    rc = 0
    for s in p.steps:
        rc = subprocess.run(s.argv).returncode
        if rc and s.check:
            raise click.ClickException(f"`{shlex.join(s.argv)}` failed with exit status {rc}")
    if p.action == "uninstall":
        p.path.unlink(missing_ok=True)
    return rc


# -- commands --------------------------------------------------------------------------------

_manifest_option = click.option(
    "--manifest",
    "-m",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Manifest the daemon warms and watches (default: the home's manifest.toml).",
)
_dry_run_option = click.option(
    "--dry-run", is_flag=True, help="Print the file path and commands instead of running them."
)


@click.group("service", context_settings={"help_option_names": ["-h", "--help"]})
def service_cmd() -> None:
    """Run `kvstore daemon` as a launchd agent (macOS) or systemd user service (Linux).

    \b
    kvstore service install --manifest pins.toml
    kvstore service status
    kvstore service print --systemd      # either file, on any OS
    """


@service_cmd.command("print")
@click.option("--launchd", "kind", flag_value="launchd", help="The LaunchAgent plist.")
@click.option("--systemd", "kind", flag_value="systemd", help="The systemd user unit.")
@_manifest_option
@home_option
def print_cmd(kind: str | None, manifest: Path | None, home: Path) -> None:
    """Print the service file (this OS's kind unless --launchd or --systemd)."""
    spec = service_spec(home, manifest)
    kind = kind or host_kind()
    text = launchd_plist(spec).decode() if kind == "launchd" else systemd_unit(spec)
    click.echo(text, nl=False)


@service_cmd.command()
@_manifest_option
@_dry_run_option
@home_option
def install(manifest: Path | None, dry_run: bool, home: Path) -> None:
    """Install, enable and start the daemon service for this home."""
    kind = host_kind()
    p = plan(kind, "install", service_spec(home, manifest))
    if not dry_run:
        require_service_manager(kind, home)
    execute(p, dry_run=dry_run)
    if not dry_run:
        click.echo(f"installed {p.path}")
        if kind == "systemd":
            click.echo("to keep it running while you are logged out: loginctl enable-linger")


@service_cmd.command()
@_dry_run_option
@home_option
def uninstall(dry_run: bool, home: Path) -> None:
    """Stop and disable the daemon service and remove its file."""
    kind = host_kind()
    p = plan(kind, "uninstall")
    if not dry_run:
        if not p.path.exists():
            raise click.ClickException(f"no kvstore service installed ({p.path} does not exist)")
        require_service_manager(kind, home)
    execute(p, dry_run=dry_run)
    if not dry_run:
        click.echo(f"removed {p.path}")


@service_cmd.command()
@_dry_run_option
@home_option
@click.pass_context
def status(ctx: click.Context, dry_run: bool, home: Path) -> None:
    """Show the service manager's view of the daemon; exits with its status code."""
    kind = host_kind()
    p = plan(kind, "status")
    if not dry_run:
        require_service_manager(kind, home)
        click.echo(f"{p.path}: {'installed' if p.path.exists() else 'not installed'}")
    ctx.exit(execute(p, dry_run=dry_run))
