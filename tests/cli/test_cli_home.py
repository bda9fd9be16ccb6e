"""A `--home` that cannot be one (a path under a file, an immutable directory, another's
directory) is one line and a non-zero exit on every command, commands that only read or remove
never create a home, and an existing directory's mode is never changed."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path
from unittest import mock

import click
import pytest
from helpers import CLASSIFY, cli, manifest_for

from kvstore.cli.main import main
from kvstore.daemon import exits

PIN = f"""[[model.prefix]]
name = "classify"
messages = [{{ role = "system", content = "{CLASSIFY}" }}]
"""


def _home_commands(group: click.Group, ctx: click.Context, path: tuple = ()):
    """Every command and group that takes --home, as its argv path."""
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        if any(p.name == "home" for p in cmd.params):
            yield (*path, name)
        if isinstance(cmd, click.Group):
            yield from _home_commands(cmd, click.Context(cmd, parent=ctx), (*path, name))


COMMANDS = sorted(_home_commands(main, click.Context(main)))


def _one_line(result) -> str:
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert "Traceback" not in result.output
    return lines[0]


@pytest.mark.parametrize("argv", [c for c in COMMANDS if c != ("daemon",)], ids=" ".join)
def test_a_home_under_a_file_is_one_line_on_every_command(tmp_path, argv):
    (tmp_path / "FILE").write_text("a regular file")
    home = tmp_path / "FILE" / "sub"
    # no other arguments: --home is checked before a missing argument is noticed
    result = cli(*argv, "--home", home)
    assert result.exit_code == 1, result.output
    line = _one_line(result)
    assert str(home) in line and f"{tmp_path / 'FILE'} is a file, not a directory" in line
    result = cli(*argv, "--home", tmp_path / "FILE")  # the home itself a file: the same
    assert result.exit_code == 1 and "is a file, not a directory" in _one_line(result)


def _foreign(tmp_path: Path) -> Path:
    home = tmp_path / "d"
    home.mkdir()
    os.chmod(home, 0o1777)
    (home / "other").write_text("someone else's")
    return home


def _under_a_file(tmp_path: Path) -> Path:
    (tmp_path / "FILE").write_text("a regular file")
    return tmp_path / "FILE" / "sub"


@pytest.mark.parametrize(
    "make, says",
    [(_under_a_file, "is a file, not a directory"),
     (_foreign, "holds other files (1) and no kvstore home")],
    ids=["under-a-file", "another's-directory"],
)  # fmt: skip
def test_the_daemon_refuses_a_home_that_cannot_be_one_with_its_config_status(tmp_path, make, says):
    home = make(tmp_path)
    mode = home.stat().st_mode if home.exists() else None
    p = subprocess.run(
        [sys.executable, "-m", "kvstore", "daemon", "--home", str(home)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == exits.CONFIG, p.stderr
    errors = [ln for ln in p.stderr.splitlines() if " ERROR " in ln]
    assert len(errors) == 1 and says in errors[0], p.stderr
    assert "Traceback" not in p.stderr
    if mode is not None:  # another's directory: its mode left as it was
        assert home.stat().st_mode == mode


def _writes(tmp_path: Path, llama_path: Path) -> dict[str, tuple]:
    manifest = manifest_for(tmp_path, llama_path, PIN)
    cache = tmp_path / "cache.safetensors"
    cache.write_bytes(b"x")
    return {
        "warm": ("warm", "--manifest", manifest),
        "evict": ("evict", "--all"),
        "import": ("import", cache, "--model", llama_path, "--prompt", "hi"),
    }


@pytest.mark.parametrize("command", ["warm", "evict", "import"])
def test_a_directory_of_other_files_is_refused_and_left_as_it_was(tmp_path, llama_path, command):
    """`--home d` where d is shared (1777) and holds another's file: d was chmod'ed 0700, locking
    everyone else out of it. kvstore never changes a directory it did not create."""
    home = _foreign(tmp_path)
    result = cli(*_writes(tmp_path, llama_path)[command], "--home", home)
    assert result.exit_code == 1, result.output
    line = _one_line(result)
    assert f"kvstore home {home}: holds other files (1) and no kvstore home" in line, line
    assert stat.S_IMODE(home.stat().st_mode) == 0o1777
    assert sorted(p.name for p in home.iterdir()) == ["other"]


@pytest.mark.parametrize("mode", [0o755, 0o1777])
def test_an_existing_empty_home_is_used_with_its_mode_kept(tmp_path, llama_path, mode):
    """An empty directory (or a kvstore home) given as --home is used as it is: warmed into, its
    mode unchanged; a home kvstore creates is 0700."""
    home = tmp_path / "h"
    home.mkdir()
    os.chmod(home, mode)
    result = cli(*_writes(tmp_path, llama_path)["warm"], "--home", home)
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE(home.stat().st_mode) == mode
    assert (home / "store" / "data.mdb").is_file()
    result = cli("ls", "--home", home)  # a home now: used again
    assert result.exit_code == 0 and "classify" in result.output, result.output
    made = tmp_path / "new" / "home"
    assert cli(*_writes(tmp_path, llama_path)["warm"], "--home", made).exit_code == 0
    assert stat.S_IMODE(made.stat().st_mode) == 0o700


def _immutable(path: Path) -> bool:
    try:
        return subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("mode", [0o755, 0o700], ids=["loose", "private"])
def test_an_immutable_home_is_one_line(tmp_path, llama_path, mode):
    home = tmp_path / "h"
    home.mkdir()
    os.chmod(home, mode)
    writes = _writes(tmp_path, llama_path)
    if not _immutable(home):
        pytest.skip("chattr +i is not available here (needs root and a file system with flags)")
    try:
        for argv in writes.values():
            result = cli(*argv, "--home", home)
            assert result.exit_code == 1, (argv, result.output)
            line = _one_line(result)
            assert str(home) in line and "Operation not permitted" in line, line
    finally:
        subprocess.run(["chattr", "-i", str(home)], check=True)


@pytest.mark.parametrize(
    "argv",
    [("evict", "--all"), ("evict", "--label", "x"), ("ls",), ("ls", "--learned"), ("stats",),
     ("verify",), ("verify", "--repair"), ("export", "abcd", "out.safetensors")],
    ids=" ".join,
)  # fmt: skip
def test_reading_or_removing_never_creates_a_home(tmp_path, argv):
    home = tmp_path / "typohome"
    result = cli(*argv, "--home", home)
    assert not home.exists(), result.output
    if argv[0] == "evict":
        assert result.exit_code == 1
        assert f"no kvstore home at {home}" in _one_line(result)


def test_a_file_the_system_refuses_is_one_line(tmp_path):
    home = tmp_path / "h"
    home.mkdir(mode=0o700)
    refused = PermissionError(13, "Permission denied", str(home / "ledger.msgpack"))
    with mock.patch("kvstore.home.ledger.Ledger.stats", side_effect=refused):
        result = cli("stats", "--home", home)
    assert result.exit_code == 1
    line = _one_line(result)
    assert str(home / "ledger.msgpack") in line and "Permission denied" in line, line


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_an_empty_home_is_refused_and_nothing_is_made_in_the_current_directory(
    tmp_path, monkeypatch, argv
):
    """`--home ""` made the current directory the home (store/ created there, chmod 0700, exit 0);
    an empty KVSTORE_HOME stays unset (the default home)."""
    monkeypatch.chdir(tmp_path)
    result = cli(*argv, "--home", "")
    assert result.exit_code == 1, result.output
    assert _one_line(result) == "Error: --home is empty; give a directory (or leave it out)"
    assert list(tmp_path.iterdir()) == []


def test_an_empty_kvstore_home_is_unset(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTORE_HOME", "")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.chdir(tmp_path)
    result = cli("ls")
    assert result.exit_code == 0, result.output
    assert "store" not in {p.name for p in tmp_path.iterdir()}


@pytest.mark.parametrize("argv", [("ls",), ("stats",), ("verify",), ("ls", "--json")], ids=" ".join)
def test_an_empty_store_file_is_the_damaged_store_line(tmp_path, argv):
    """A 0-byte data.mdb read: "cannot open the LMDB store: Bad file descriptor", no advice."""
    data = tmp_path / "store" / "data.mdb"
    data.parent.mkdir(parents=True)
    data.touch()
    result = cli(*argv, "--home", tmp_path)
    assert result.exit_code == 1, result.output
    line = _one_line(result)
    assert f"{data}: the store file is empty (0 bytes)" in line and "move it aside" in line
    assert data.stat().st_size == 0  # left as it was


@pytest.mark.parametrize("argv", [c for c in COMMANDS if c != ("daemon",)], ids=" ".join)
def test_a_store_that_is_a_file_is_one_line(tmp_path, argv):
    """`store` a regular file: `ls` said "0 entries" and exit 0."""
    (tmp_path / "store").write_text("not a directory")
    result = cli(*argv, "--home", tmp_path)
    assert result.exit_code == 1, result.output
    assert (
        _one_line(result)
        == f"Error: {tmp_path / 'store'}: is a file, not the store's directory; move it aside"
    )
