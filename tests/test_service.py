"""Service files (launchd plist, systemd user unit) and `kvstore service`."""

from __future__ import annotations

import configparser
import os
import plistlib
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from daemon import service
from daemon.service import LABEL, UNIT_NAME, launchd_plist, service_spec, systemd_unit
from kvstore.cli import main

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
    assert args == ["daemon", "--home", ODD_HOME, "--manifest", str(manifest)]
    assert job["Label"] == LABEL
    assert job["RunAtLoad"] is True
    assert job["KeepAlive"] == {"SuccessfulExit": False}
    assert isinstance(job["ThrottleInterval"], int) and job["ThrottleInterval"] >= 1
    assert isinstance(job["ExitTimeOut"], int) and job["ExitTimeOut"] > 5  # daemon stops in 5 s
    assert job["ProcessType"] in {"Background", "Standard", "Adaptive", "Interactive"}
    assert job["EnvironmentVariables"]["KVSTORE_HOME"] == ODD_HOME
    logs = user_home / "Library" / "Logs" / "kvstore"
    assert Path(job["StandardOutPath"]).parent == logs
    assert Path(job["StandardErrorPath"]).parent == logs


def test_relative_paths_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = plistlib.loads(launchd_plist(service_spec(Path("h"), Path("pins.toml"))))
    assert job["ProgramArguments"][-3:] == [
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
    result = CliRunner().invoke(main, ["service", "print", f"--{kind}"])
    assert result.exit_code == 0, result.output
    if kind == "launchd":
        job = plistlib.loads(result.output.encode())
        assert job["ProgramArguments"][1:] == ["daemon", "--home", str(kv_home)]
    else:
        assert _unit(result.output)["Service"]["Restart"] == "on-failure"


def test_install_dry_run_systemd(monkeypatch, tmp_path, kv_home):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setattr(service, "host_kind", lambda: "systemd")
    result = CliRunner().invoke(main, ["service", "install", "--dry-run"])
    assert result.exit_code == 0, result.output
    unit = tmp_path / "config" / "systemd" / "user" / UNIT_NAME
    assert f"would write {unit}" in result.output
    assert "systemctl --user daemon-reload" in result.output
    assert f"systemctl --user enable --now {UNIT_NAME}" in result.output
    assert not unit.exists()


def test_install_dry_run_launchd(monkeypatch, user_home):
    monkeypatch.setattr(service, "host_kind", lambda: "launchd")
    result = CliRunner().invoke(main, ["service", "install", "--dry-run"])
    assert result.exit_code == 0, result.output
    plist = user_home / "Library" / "LaunchAgents" / f"{LABEL}.plist"
    assert f"would write {plist}" in result.output
    assert f"launchctl bootstrap gui/{os.getuid()} {plist}" in result.output
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
    result = CliRunner().invoke(main, ["service", "install"])
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
    result = CliRunner().invoke(main, ["service", "install"])
    assert result.exit_code == 1
    assert len(result.output.strip().splitlines()) == 1
    assert "no systemd user manager" in result.output and "No medium found" in result.output


def test_install_then_uninstall_runs_systemctl_in_order(monkeypatch, tmp_path):
    monkeypatch.setattr(service, "host_kind", lambda: "systemd")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    log = _fake_systemctl(tmp_path / "bin", works=True)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    unit = tmp_path / "config" / "systemd" / "user" / UNIT_NAME

    result = CliRunner().invoke(main, ["service", "install"])
    assert result.exit_code == 0, result.output
    assert _unit(unit.read_text())["Service"]["Restart"] == "on-failure"
    calls = log.read_text().splitlines()
    assert calls[-3:] == [
        "--user daemon-reload",
        f"--user try-restart {UNIT_NAME}",
        f"--user enable --now {UNIT_NAME}",
    ]

    result = CliRunner().invoke(main, ["service", "uninstall"])
    assert result.exit_code == 0, result.output
    assert f"--user disable --now {UNIT_NAME}" in log.read_text()
    assert not unit.exists()


def test_other_platforms_get_a_clear_error(monkeypatch):
    monkeypatch.setattr(sys, "platform", "win32")
    with pytest.raises(click.ClickException, match="run `kvstore daemon`"):
        service.host_kind()
