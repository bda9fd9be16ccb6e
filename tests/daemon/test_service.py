"""Service files (launchd plist, systemd user unit) and `kvstore service`."""

from __future__ import annotations

import configparser
import json
import os
import plistlib
import shlex
import shutil
import stat
import subprocess
import sys
import unicodedata
from pathlib import Path

import click
import pytest
from helpers import cli

from kvstore.daemon import exits
from kvstore.daemon.cli.service import command as service
from kvstore.daemon.cli.service import launchd
from kvstore.daemon.cli.service.command import (
    LABEL,
    UNIT_NAME,
    launchd_plist,
    service_spec,
    systemd_unit,
)

# A macOS-like home plus every character systemd would otherwise interpret.
ODD_HOME = '/Users/Jane Doe/Library/Application Support/kv "store"\\$HOME 100%'


@pytest.fixture(autouse=True)
def user_home(tmp_path, monkeypatch) -> Path:
    """Service files land under a temporary user home, never the real one."""
    home = tmp_path / "user"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    for name in service.PASS_THROUGH_ENV:
        monkeypatch.delenv(name, raising=False)
    return home


def systemd_split(line: str) -> list[str]:
    """ExecStart= word splitting as systemd does it: double-quoted words with C escapes, then
    `%%` -> `%` (specifiers) and `$$` -> `$` (environment references)."""
    words, i = [], 0
    escapes = {"\\": "\\", '"': '"', "n": "\n", "t": "\t"}
    while i < len(line):
        if line[i].isspace():
            i += 1
            continue
        assert line[i] == '"', f"unquoted word at {i}: {line[i:]!r}"
        i, word = i + 1, []
        while line[i] != '"':
            if line[i] == "\\":
                word.append(escapes[line[i + 1]])
                i += 2
            else:
                word.append(line[i])
                i += 1
        i += 1
        text = "".join(word)
        for special in "%$":
            parts = text.split(special * 2)
            assert all(special not in p for p in parts), f"bare {special} in {text!r}"
            text = special.join(parts)
        words.append(text)
    return words


def test_launchd_plist_has_every_key(tmp_path, user_home):
    manifest = tmp_path / "pins.toml"
    job = plistlib.loads(launchd_plist(service_spec(Path(ODD_HOME), manifest)))
    program, *args = job["ProgramArguments"]
    assert Path(program).is_absolute() and os.access(program, os.X_OK)
    assert Path(program).name == "kvstore"
    logs = user_home / "Library" / "Logs" / "kvstore"
    assert args == [
        "daemon", "--home", ODD_HOME, "--manifest", str(manifest),
        "--log-file", str(logs / "daemon.log"),
    ]  # fmt: skip
    assert job["Label"] == LABEL
    assert job["RunAtLoad"] is True
    assert job["KeepAlive"] == {"SuccessfulExit": False}
    assert isinstance(job["ThrottleInterval"], int) and job["ThrottleInterval"] >= 1
    # launchd's SIGKILL comes after ExitTimeOut; the bootout wait outlasts it.
    assert isinstance(job["ExitTimeOut"], int) and job["ExitTimeOut"] >= 20
    assert launchd.BOOTOUT_DEADLINE > job["ExitTimeOut"]
    assert job["ProcessType"] == "Interactive"  # unthrottled boot warm (launchd.plist(5))
    assert job["EnvironmentVariables"]["KVSTORE_HOME"] == ODD_HOME
    assert job["EnvironmentVariables"][exits.SUPERVISOR_ENV] == "launchd"
    # Only crash output goes where launchd appends without rotating; the daemon rotates its log.
    assert job["StandardOutPath"] == job["StandardErrorPath"] == str(logs / "daemon.stderr.log")


def test_relative_paths_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = plistlib.loads(launchd_plist(service_spec(Path("h"), Path("pins.toml"))))
    assert job["ProgramArguments"][2:6] == [
        "--home",
        str(tmp_path / "h"),
        "--manifest",
        str(tmp_path / "pins.toml"),
    ]


def test_hub_cache_location_follows_the_installer(monkeypatch):
    monkeypatch.setenv("HF_HOME", "/data/hf")
    assert service_spec(Path("/h")).env["HF_HOME"] == "/data/hf"


def _unit(text: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string(text)
    return parser


def test_systemd_unit_parses_and_quotes_a_home_with_spaces(tmp_path):
    manifest = tmp_path / "my pins.toml"
    spec = service_spec(Path(ODD_HOME), manifest)
    unit = _unit(systemd_unit(spec))
    svc = unit["Service"]
    assert svc["Type"] == "simple"
    assert svc["Restart"] == "on-failure"
    assert svc["RestartPreventExitStatus"] == str(exits.CONFIG)
    assert float(svc["RestartSec"]) >= 1
    assert unit["Install"]["WantedBy"] == "default.target"
    assert systemd_split(svc["ExecStart"]) == spec.argv
    assert spec.argv[1:] == ["daemon", "--home", ODD_HOME, "--manifest", str(manifest)]
    assert Path(spec.argv[0]).is_absolute()
    env_lines = [ln for ln in systemd_unit(spec).splitlines() if ln.startswith("Environment=")]
    assert any(
        systemd_split(ln.removeprefix("Environment=").replace("$", "$$"))
        == [f"KVSTORE_HOME={ODD_HOME}"]
        for ln in env_lines
    )


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
def test_systemd_itself_reads_the_program_path_as_one_word(tmp_path):
    # A program path with a space that does not exist: systemd's own complaint names it whole.
    spec = service_spec(Path(ODD_HOME))
    spec.argv[0] = str(tmp_path / "no such" / "kvstore")
    unit = tmp_path / UNIT_NAME
    unit.write_text(systemd_unit(spec))
    done = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True
    )
    assert f"Command {spec.argv[0]} is not executable" in done.stderr
    assert "parse" not in done.stderr.lower() and "escape" not in done.stderr.lower()


@pytest.mark.parametrize("kind", ["launchd", "systemd"])
def test_print_through_the_cli(kind, kv_home):
    result = cli("service", "print", f"--{kind}")
    assert result.exit_code == 0, result.output
    if kind == "launchd":
        job = plistlib.loads(result.output.encode())
        assert job["ProgramArguments"][1:4] == ["daemon", "--home", str(kv_home)]
    else:
        assert _unit(result.output)["Service"]["Restart"] == "on-failure"


def test_install_dry_run_systemd(monkeypatch, tmp_path, kv_home):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setattr(service, "host_kind", lambda: "systemd")
    result = cli("service", "install", "--dry-run")
    assert result.exit_code == 0, result.output
    unit = tmp_path / "config" / "systemd" / "user" / UNIT_NAME
    assert f"would write {unit} (mode 644)" in result.output
    assert "systemctl --user daemon-reload" in result.output
    assert f"systemctl --user enable --now {UNIT_NAME}" in result.output
    assert not unit.exists()


def test_install_dry_run_launchd(monkeypatch, user_home):
    monkeypatch.setattr(service, "host_kind", lambda: "launchd")
    result = cli("service", "install", "--dry-run")
    assert result.exit_code == 0, result.output
    plist = user_home / "Library" / "LaunchAgents" / f"{LABEL}.plist"
    lines = result.output.splitlines()
    target = f"gui/{os.getuid()}/{LABEL}"
    # Bootout, wait for the old job to be gone, then write and bootstrap (retried on 5/37).
    assert lines[0] == f"launchctl bootout {target}"
    assert lines[1].startswith(f"wait until `launchctl print {target}` fails")
    assert lines[2] == f"would write {plist} (mode 644)"
    assert lines[-1].startswith(f"launchctl bootstrap gui/{os.getuid()} {plist}")
    assert not plist.exists()


def _fake_systemctl(bin_dir: Path, *, works: bool) -> Path:
    """A `systemctl` that logs its arguments; `works=False` behaves like a container's."""
    bin_dir.mkdir(exist_ok=True)
    log = bin_dir / "calls.log"
    body = f'echo "$*" >> {shlex.quote(str(log))}\n'  # PATH holds nothing else: no dirname
    if not works:
        body += 'echo "Failed to connect to bus: No medium found" >&2; exit 1\n'
    tool = bin_dir / "systemctl"
    tool.write_text("#!/bin/sh\n" + body)
    tool.chmod(0o755)
    return log


def test_install_without_systemctl_is_one_clear_line(monkeypatch, tmp_path):
    monkeypatch.setattr(service, "host_kind", lambda: "systemd")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    result = cli("service", "install")
    assert result.exit_code == 1
    message = result.output.strip()
    assert len(message.splitlines()) == 1
    assert "systemctl not found" in message and "kvstore daemon --home" in message
    assert not (tmp_path / "config" / "systemd").exists()


def test_install_without_a_user_manager_is_one_clear_line(monkeypatch, tmp_path):
    monkeypatch.setattr(service, "host_kind", lambda: "systemd")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    _fake_systemctl(tmp_path / "bin", works=False)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    result = cli("service", "install")
    assert result.exit_code == 1
    assert len(result.output.strip().splitlines()) == 1
    assert "no systemd user manager" in result.output and "No medium found" in result.output


def test_install_then_uninstall_runs_systemctl_in_order(monkeypatch, tmp_path):
    monkeypatch.setattr(service, "host_kind", lambda: "systemd")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    log = _fake_systemctl(tmp_path / "bin", works=True)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    unit = tmp_path / "config" / "systemd" / "user" / UNIT_NAME

    result = cli("service", "install")
    assert result.exit_code == 0, result.output
    assert _unit(unit.read_text())["Service"]["Restart"] == "on-failure"
    calls = log.read_text().splitlines()
    assert calls[-3:] == [
        "--user daemon-reload",
        f"--user try-restart {UNIT_NAME}",
        f"--user enable --now {UNIT_NAME}",
    ]

    result = cli("service", "uninstall")
    assert result.exit_code == 0, result.output
    assert f"--user disable --now {UNIT_NAME}" in log.read_text()
    assert not unit.exists()


def test_other_platforms_get_a_clear_error(monkeypatch):
    monkeypatch.setattr(sys, "platform", "win32")
    with pytest.raises(click.ClickException, match="run `kvstore daemon`"):
        service.host_kind()


# -- launchd through a fake launchctl (tests/daemon/fake_launchctl.py) -------------------------


class FakeLaunchd:
    def __init__(self, root: Path):
        self.dir = root

    def state(self) -> dict:
        return json.loads((self.dir / "state.json").read_text())

    def set_state(self, **kw) -> None:
        path = self.dir / "state.json"
        state = json.loads(path.read_text()) if path.exists() else {"jobs": {}, "next_pid": 4100}
        state.update(kw)
        path.write_text(json.dumps(state))

    def calls(self) -> list[str]:
        log = self.dir / "calls.log"
        return log.read_text().splitlines() if log.exists() else []


@pytest.fixture
def fake_launchd(tmp_path, monkeypatch) -> FakeLaunchd:
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    tool = bin_dir / "launchctl"
    script = Path(__file__).with_name("fake_launchctl.py")
    tool.write_text(
        f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(script))} "$@"\n'
    )
    tool.chmod(0o755)
    state = tmp_path / "launchd"
    state.mkdir()
    monkeypatch.setenv("FAKE_LAUNCHD_DIR", str(state))
    monkeypatch.setenv("FAKE_LAUNCHD_EXIT_DELAY", "1.0")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(service, "host_kind", lambda: "launchd")
    monkeypatch.setattr(launchd, "POLL_SECONDS", 0.1)
    return FakeLaunchd(state)


def _install(*args: str):
    return cli("service", "install", *args)


def test_reinstall_waits_for_the_old_job_then_bootstraps(fake_launchd, user_home):
    first = _install()
    assert first.exit_code == 0, first.output
    old_pid = fake_launchd.state()["jobs"][LABEL]["pid"]
    # The old job takes 1 s to exit after bootout; bootstrapping before that fails with 5.
    second = _install()
    assert second.exit_code == 0, second.output
    job = fake_launchd.state()["jobs"][LABEL]
    assert job["pid"] != old_pid and "gone_at" not in job  # a fresh job runs
    calls = fake_launchd.calls()
    last = calls[max(i for i, c in enumerate(calls) if c.startswith("bootout")) :]
    target = f"gui/{os.getuid()}/{LABEL}"
    assert last[1:3] == [f"print {target}"] * 2  # still there: waited, polling print
    assert last[-2:] == [f"enable {target}", f"bootstrap gui/{os.getuid()} {launchd.plist_path()}"]


def test_bootstrap_is_retried_on_37(fake_launchd, user_home):
    fake_launchd.set_state(flaky_bootstraps=2)
    result = _install()
    assert result.exit_code == 0, result.output
    assert sum(c.startswith("bootstrap") for c in fake_launchd.calls()) == 3
    assert LABEL in fake_launchd.state()["jobs"]


def test_bootstrap_failure_not_retried_is_one_clear_line(fake_launchd, user_home, monkeypatch):
    monkeypatch.setattr(launchd, "BOOTSTRAP_RETRY", frozenset())
    fake_launchd.set_state(flaky_bootstraps=1)
    result = _install()
    assert result.exit_code == 1
    assert len(result.output.strip().splitlines()) == 1
    assert "Bootstrap failed: 37" in result.output and "exit 37" in result.output


def test_plist_is_0644_under_umask_002(fake_launchd, user_home):
    old = os.umask(0o002)
    try:
        result = _install()
    finally:
        os.umask(old)
    assert result.exit_code == 0, (
        result.output
    )  # the fake skips group-writable plists, as launchctl
    path = launchd.plist_path()
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    job = plistlib.loads(path.read_bytes())
    assert job["Label"] == LABEL and job["KeepAlive"] == {"SuccessfulExit": False}


def test_uninstall_waits_until_launchd_forgot_the_job(fake_launchd, user_home):
    assert _install().exit_code == 0
    result = cli("service", "uninstall")
    assert result.exit_code == 0, result.output
    assert LABEL not in fake_launchd.state()["jobs"]  # gone, not just asked to go
    assert not launchd.plist_path().exists()


def test_status_shows_what_a_user_debugging_the_agent_needs(fake_launchd, user_home, kv_home):
    assert _install().exit_code == 0
    log = launchd.log_dir() / launchd.LOG_NAME
    log.write_text("".join(f"line {i}\n" for i in range(30)) + "cannot start: socket refused\n")
    state = fake_launchd.state()
    state["jobs"][LABEL].update(pid=None, last_exit=exits.CONFIG)
    fake_launchd.set_state(**state)
    result = cli("service", "status")
    out = result.output
    assert result.exit_code == 3, out  # not answering
    assert "loaded:    yes (not running)" in out
    assert "pid:       not running" in out
    assert f"last exit: {exits.CONFIG} (config: configuration refused" in out
    assert f"file:      {launchd.plist_path()} (mode 644)" in out
    assert f"log:       {log}" in out and "  cannot start: socket refused" in out
    assert "  line 19" not in out  # the last lines only
    assert "socket:" in out and "no answer" in out


def test_status_of_a_running_job_with_its_pid(fake_launchd, user_home):
    assert _install().exit_code == 0
    pid = fake_launchd.state()["jobs"][LABEL]["pid"]
    out = cli("service", "status").output
    assert "loaded:    yes (running)" in out and f"pid:       {pid}" in out
    assert "last exit: none yet" in out


def test_status_when_not_loaded(fake_launchd, user_home):
    out = cli("service", "status").output
    assert "loaded:    no" in out and "(not installed)" in out


def test_parse_print_matches_brew_services_fields():
    text = "gui/501/x = {\n\tstate = running\n\tpid = 812\n\tlast exit code = 78\n}\n"
    assert launchd.parse_print(text) == {"state": "running", "pid": "812", "last_exit": "78"}


# -- the exit table and the service files agree -----------------------------------------------


def test_service_files_restart_exactly_what_the_exit_table_says():
    unit = _unit(systemd_unit(service_spec(Path("/h"))))["Service"]
    assert unit["Restart"] == "on-failure"
    prevented = {int(c) for c in unit["RestartPreventExitStatus"].split()}
    for name, rule in exits.EXITS.items():
        if rule.code is None:
            continue
        systemd_restarts = rule.code != 0 and rule.code not in prevented
        assert systemd_restarts == rule.restart, name
        # launchd restarts every non-zero exit; a non-zero no-restart one must park instead.
        if exits.restarted_by_launchd(rule.code) and not rule.restart:
            assert "launchd" in exits.PARK_UNDER, name


# -- privacy-protected locations (TCC) --------------------------------------------------------


@pytest.mark.parametrize(
    "where", ["Documents", "Desktop", "Downloads", "Library/Mobile Documents/com~apple~CloudDocs"]
)
def test_install_warns_about_tcc_protected_paths(where, fake_launchd, user_home):
    folder = user_home / where / "kv"
    folder.mkdir(parents=True)
    manifest = folder / "pins.toml"
    manifest.write_text("")
    result = cli("service", "install", "--dry-run", "-m", manifest)
    assert result.exit_code == 0, result.output
    top = "~/" + where.split("/com~")[0]
    assert f"the manifest {manifest} is under {top}" in result.output
    assert "Full Disk Access" in result.output and "move these out" in result.output


def test_tcc_match_ignores_case_and_normalization(user_home):
    docs = user_home / "Documents"
    docs.mkdir()
    nfd = unicodedata.normalize("NFD", "Café")
    assert service.tcc_location(user_home / "documents" / nfd, user_home) == "~/Documents"
    assert service.tcc_location(Path("/Volumes/USB/venv"), user_home) == "/Volumes"
    assert service.tcc_location(user_home / "Library" / "Application Support", user_home) is None


def test_install_outside_protected_paths_warns_nothing(fake_launchd, tmp_path):
    manifest = tmp_path / "pins.toml"
    manifest.write_text("")
    result = cli("service", "install", "--dry-run", "-m", manifest)
    assert "warning" not in result.output


def test_install_warns_about_a_manifest_models_protected_paths(fake_launchd, tmp_path, user_home):
    """The manifest's models and adapters are read by the daemon too: each one under a protected
    location is named."""
    docs = user_home / "Documents"
    model, adapter = docs / "model", docs / "adapter"
    model.mkdir(parents=True)
    adapter.mkdir()
    manifest = tmp_path / "pins.toml"
    manifest.write_text(f'[[model]]\npath = "{model}"\nadapter = "{adapter}"\n')
    result = cli("service", "install", "--dry-run", "-m", manifest)
    assert result.exit_code == 0, result.output
    assert f"the model {model} {model} is under ~/Documents" in result.output
    assert f"the adapter {adapter} {adapter} is under ~/Documents" in result.output
    assert "the manifest" not in result.output


# -- systemd status through a fake systemctl --------------------------------------------------


def test_systemd_status_reads_systemctl_show(monkeypatch, tmp_path):
    monkeypatch.setattr(service, "host_kind", lambda: "systemd")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    bin_dir = tmp_path / "bin"
    _fake_systemctl(bin_dir, works=True)
    tool = bin_dir / "systemctl"
    tool.write_text(
        tool.read_text()
        + 'case "$*" in *show*) printf "LoadState=loaded\\nActiveState=failed\\nSubState=failed\\n'
        f'MainPID=0\\nExecMainStatus={exits.CONFIG}\\n";; esac\n'
    )
    monkeypatch.setenv("PATH", str(bin_dir))
    result = cli("service", "status")
    out = result.output
    assert result.exit_code == 3, out
    assert "loaded:    yes (failed (failed))" in out
    assert f"last exit: {exits.CONFIG} (config:" in out
    assert "pid:       not running" in out


@pytest.mark.slow
def test_status_says_the_socket_answers_when_the_daemon_runs(fake_launchd, user_home, kv_home):
    from helpers import Proc

    assert _install().exit_code == 0
    d = Proc(kv_home, log=kv_home.parent / "d.log")
    try:
        d.wait_ready()
        result = cli("service", "status")
    finally:
        assert d.stop()[0] == 0
    assert result.exit_code == 0, result.output
    assert f"answers (pid {d.pid})" in result.output


def test_systemd_unit_tells_the_daemon_its_supervisor():
    text = systemd_unit(service_spec(Path("/h")))
    assert f'Environment="{exits.SUPERVISOR_ENV}=systemd"' in text.splitlines()
