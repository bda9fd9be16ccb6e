"""The [remote] table: without one, every `kvstore remote` command says where it goes and where a
sample is; the sample `kvstore remote --help` shows is a table the settings reader accepts."""

from __future__ import annotations

import sys

import pytest
from helpers import cli

from kvstore.fleet.remote_settings import REMOTE_SAMPLE, parse_remote

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@pytest.mark.parametrize("command", [["status"], ["ls"], ["push"], ["gc", "--older-than", "30d"]])
def test_no_remote_table_says_where_it_goes_and_where_a_sample_is(kv_home, command):
    kv_home.mkdir()
    (kv_home / "settings.toml").write_text("max_bytes = 1073741824\n")
    result = cli("remote", *command, "--home", kv_home)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    (line,) = result.output.strip().splitlines()
    assert f"{kv_home / 'settings.toml'}: no [remote] table" in line
    assert "`kvstore remote --help` shows a sample" in line


def test_the_sample_in_remote_help_is_a_valid_table(kv_home):
    result = cli("remote", "--help")
    shown = [line.strip() for line in result.output.splitlines()]
    sample = [line.strip() for line in REMOTE_SAMPLE.splitlines()]
    start = shown.index(sample[0])
    assert shown[start : start + len(sample)] == sample
    settings = parse_remote(tomllib.loads(REMOTE_SAMPLE)["remote"], source=kv_home / "s.toml")
    assert settings.endpoint.startswith("http") and settings.bucket


def test_box_id_is_made_once_and_kept_in_the_home(tmp_path):
    import pytest

    from kvstore.fleet.remote_settings import RemoteSettingsError, box_id

    made = box_id(tmp_path)
    assert made.startswith("box-") and box_id(tmp_path) == made
    assert (tmp_path / "box_id").read_text().strip() == made
    assert sorted(p.name for p in tmp_path.iterdir()) == ["box_id"]  # no temporary left
    with pytest.raises(RemoteSettingsError, match="cannot make this box's id"):
        box_id(tmp_path / "missing")
