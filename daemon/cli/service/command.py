"""`kvstore service`: run the daemon as a launchd LaunchAgent (macOS) or systemd user unit (Linux).

`print --launchd|--systemd` renders either file on any OS; `install`, `uninstall` and `status`
act on this OS's kind (daemon/cli/service/launchd.py, systemd.py), `--dry-run` shows the steps.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import unicodedata
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import click

from kvstore.cli.options import home_option
from kvstore.daemon import exits
from kvstore.daemon.cli.service import launchd, systemd

LABEL = launchd.LABEL
UNIT_NAME = systemd.UNIT_NAME
# Installer variables the daemon needs to find the same models (launchd and systemd start
# services with a minimal environment).
PASS_THROUGH_ENV = ("HF_HOME", "HF_HUB_CACHE")
# Where macOS privacy protection (TCC) refuses a launchd job without Full Disk Access: the
# "Files and Folders" entries of System Settings > Privacy & Security (plus iCloud Drive).
TCC_DIRS = ("Desktop", "Documents", "Downloads", "Library/Mobile Documents")
TCC_VOLUMES = Path("/Volumes")  # removable and network volumes
STATUS_LOG_LINES = 10


@dataclass(frozen=True)
class ServiceSpec:
    """What the service runs: `argv` plus its environment."""

    argv: list[str]
    home: Path
    env: dict[str, str] = field(default_factory=dict)
    manifest: Path | None = None


def kvstore_program() -> list[str]:
    """The absolute command that runs this installation's CLI: the venv's `kvstore` script next
    to this interpreter, else the one on PATH, else `python -m kvstore`."""
    sibling = Path(os.path.abspath(sys.executable)).parent / "kvstore"
    if sibling.is_file() and os.access(sibling, os.X_OK):
        return [str(sibling)]
    if found := shutil.which("kvstore"):
        return [os.path.abspath(found)]
    return [os.path.abspath(sys.executable), "-m", "kvstore"]


def service_spec(home: Path, manifest: Path | None = None) -> ServiceSpec:
    # Absolute paths: services start in / (launchd) or the user's home (systemd).
    home = Path(os.path.abspath(home))
    argv = [*kvstore_program(), "daemon", "--home", str(home)]
    if manifest is not None:
        manifest = Path(os.path.abspath(manifest))
        argv += ["--manifest", str(manifest)]
    env = {"KVSTORE_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    env.update({k: os.environ[k] for k in PASS_THROUGH_ENV if os.environ.get(k)})
    return ServiceSpec(argv=argv, home=home, env=env, manifest=manifest)


def launchd_plist(spec: ServiceSpec) -> bytes:
    return launchd.plist(spec.argv, spec.env)


def systemd_unit(spec: ServiceSpec) -> str:
    return systemd.unit(spec.argv, spec.env, spec.home)


# -- privacy-protected locations (TCC) -------------------------------------------------------


def _fold(path: str) -> str:
    # APFS and HFS+ are case-insensitive by default and store either normalization form.
    return unicodedata.normalize("NFC", path).casefold()


def tcc_location(path: Path, user_home: Path | None = None) -> str | None:
    """The protected location `path` lies in (e.g. "~/Documents"), or None."""
    user_home = user_home or Path.home()
    real = _fold(os.path.realpath(path))
    roots = [(f"~/{d}", user_home / d) for d in TCC_DIRS] + [(str(TCC_VOLUMES), TCC_VOLUMES)]
    for name, root in roots:
        r = _fold(os.path.realpath(root))
        if real == r or real.startswith(r.rstrip("/") + "/"):
            return name
    return None


def service_paths(spec: ServiceSpec) -> list[tuple[str, Path]]:
    """What the daemon must read under launchd: the program, its venv, the home, the manifest,
    and the manifest's models and adapters, and the hub cache."""
    out = [("program", Path(spec.argv[0])), ("venv", Path(sys.prefix)), ("home", spec.home)]
    for k in PASS_THROUGH_ENV:
        if spec.env.get(k):
            out.append((k, Path(spec.env[k])))
    if spec.manifest is not None:
        out.append(("manifest", spec.manifest))
        from kvstore.errors import KVStoreError
        from kvstore.identity.fingerprint import resolve_model_path
        from kvstore.pins.manifest import load_manifest

        try:
            m = load_manifest(spec.manifest)
        except KVStoreError:
            m = None
        for model in m.models if m else []:
            try:
                out.append((f"model {model.path}", resolve_model_path(model.path)))
            except KVStoreError:
                pass
            if adapter := model.identity.adapter:
                out.append((f"adapter {adapter}", Path(adapter).expanduser()))
    return out


def tcc_warnings(spec: ServiceSpec) -> list[str]:
    found = [(what, p, loc) for what, p in service_paths(spec) if (loc := tcc_location(p))]
    lines = [
        f"warning: the {what} {p} is under {loc}: macOS privacy protection (TCC) refuses "
        "a launchd job there without Full Disk Access (the daemon gets 'Operation not "
        "permitted'; a volume may also be unmounted at login)"
        for what, p, loc in found
    ]
    if lines:
        lines.append(
            "  move these out (e.g. under ~/Library/Application Support or ~/.local) and install "
            f"again, or give {os.path.realpath(sys.executable)} Full Disk Access in System "
            "Settings > Privacy & Security"
        )
    return lines


# -- plumbing ----------------------------------------------------------------------------------


def host_kind() -> str:
    if sys.platform == "darwin":
        return "launchd"
    if sys.platform.startswith("linux"):
        return "systemd"
    raise click.ClickException(
        f"kvstore service supports macOS (launchd) and Linux (systemd), not {sys.platform}; "
        "run `kvstore daemon` under your own supervisor"
    )


def _by_hand(home: Path | None) -> str:
    where = f" --home {shlex.quote(str(home))}" if home else ""
    return f"run `kvstore daemon{where}` by hand (or under your own supervisor) instead"


def require_service_manager(kind: str, home: Path | None = None) -> None:
    """Fail with one line when launchctl / the systemd user manager cannot be reached."""
    tool, probe = (
        ("launchctl", ["launchctl", "print", launchd.domain()])
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


def file_path(kind: str) -> Path:
    return launchd.plist_path() if kind == "launchd" else systemd.unit_path()


def tail(path: Path, n: int = STATUS_LOG_LINES) -> list[str]:
    try:
        with path.open(errors="replace") as f:
            return list(deque((line.rstrip("\n") for line in f), maxlen=n))
    except OSError:
        return []


def socket_answer(home: Path) -> str:
    from kvstore.errors import KVStoreError
    from kvstore.wire.daemon_client import connect, socket_path
    from kvstore.wire.messages import PingRequest

    try:
        where = socket_path(home)
        c = connect(home, timeout=5)
        if c is None:
            return f"{where}: no answer"
        with c:
            pid = c.send(PingRequest()).pid
        return f"{where}: answers (pid {pid})"
    except (KVStoreError, OSError) as e:
        return f"no answer ({e})"


def explain_exit(code: int | None) -> str:
    if code is None:
        return "none yet"
    rules = [f"{k}: {r.when}" for k, r in exits.EXITS.items() if r.code == code]
    return f"{code} ({'; '.join(rules) or 'not a status kvstore exits with: a signal or crash'})"


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
    """Install, enable and (re)start the daemon service for this home."""
    kind = host_kind()
    spec = service_spec(home, manifest)
    if kind == "launchd":
        for line in tcc_warnings(spec):
            click.echo(line, err=True)
    if dry_run:
        steps = launchd.dry_run_install() if kind == "launchd" else systemd.dry_run_install()
        click.echo("\n".join(f"would {s}" if s.startswith("write") else s for s in steps))
        return
    require_service_manager(kind, home)
    if kind == "launchd":
        path = launchd.install(launchd_plist(spec))
        click.echo(f"installed {path}; logs in {launchd.log_dir()}")
    else:
        path = systemd.install(systemd_unit(spec))
        click.echo(f"installed {path}; logs: journalctl --user -u {UNIT_NAME}")
        click.echo("to keep it running while you are logged out: loginctl enable-linger")


@service_cmd.command()
@_dry_run_option
@home_option
def uninstall(dry_run: bool, home: Path) -> None:
    """Stop and disable the daemon service and remove its file."""
    kind = host_kind()
    if dry_run:
        steps = launchd.dry_run_uninstall() if kind == "launchd" else systemd.dry_run_uninstall()
        click.echo("\n".join(steps))
        return
    path = file_path(kind)
    if not path.exists():
        raise click.ClickException(f"no kvstore service installed ({path} does not exist)")
    require_service_manager(kind, home)
    path = launchd.uninstall() if kind == "launchd" else systemd.uninstall()
    click.echo(f"removed {path}")


@service_cmd.command()
@_dry_run_option
@home_option
@click.pass_context
def status(ctx: click.Context, dry_run: bool, home: Path) -> None:
    """What a user debugging the service needs: loaded, pid, last exit status, the file and its
    mode, the log and its last lines, whether the socket answers. Exit 0 only when it answers."""
    kind = host_kind()
    path = file_path(kind)
    if dry_run:
        probe = (
            f"launchctl print {launchd.target()}"
            if kind == "launchd"
            else f"systemctl --user show -p {','.join(systemd.SHOW)} {UNIT_NAME}"
        )
        click.echo(f"would read {path}\n{probe}")
        return
    require_service_manager(kind, home)
    info = launchd.status() if kind == "launchd" else systemd.status()
    mode = f"mode {path.stat().st_mode & 0o777:o}" if path.exists() else "not installed"
    click.echo(f"service:   {info['manager']}")
    loaded = "yes" if info["loaded"] else "no"
    click.echo(f"loaded:    {loaded}" + (f" ({info['state']})" if info.get("state") else ""))
    if info.get("error"):
        click.echo(f"error:     {info['error']}")
    click.echo(f"pid:       {info.get('pid') or 'not running'}")
    click.echo(f"last exit: {explain_exit(info.get('last_exit'))}")
    click.echo(f"file:      {path} ({mode})")
    for log in info.get("logs", []):
        lines = tail(log)
        click.echo(f"log:       {log}" + ("" if log.exists() else " (not written yet)"))
        for line in lines:
            click.echo(f"  {line}")
    if "journal" in info:
        click.echo(f"log:       journalctl --user -u {UNIT_NAME}")
        for line in info["journal"] or []:
            click.echo(f"  {line}")
    answer = socket_answer(home)
    click.echo(f"socket:    {answer}")
    ctx.exit(0 if ": answers" in answer else 3)
