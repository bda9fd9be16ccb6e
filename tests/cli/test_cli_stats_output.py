"""`kvstore fingerprint` prints what its help promises (fingerprint and template hash), and
`kvstore stats` shows settings in their units, aligned, with the raw numbers in --json."""

from __future__ import annotations

import json

from helpers import cli


def test_fingerprint_prints_the_fingerprint_and_the_template_hash(llama_path):
    out = cli("fingerprint", llama_path, code=0).output
    assert "template hash" in cli("fingerprint", "--help", code=0).output  # the promise
    fields = dict(line.split() for line in out.splitlines())  # `name value`, one a line
    js = json.loads(cli("fingerprint", llama_path, "--json", code=0).output)
    assert fields == {"fingerprint": js["fingerprint"], "template_hash": js["template_hash"]}
    assert len(fields["template_hash"]) == 32 and fields["template_hash"] != fields["fingerprint"]


def test_stats_shows_settings_in_units_aligned_and_raw_in_json(kv_home):
    kv_home.mkdir()
    (kv_home / "settings.toml").write_text("max_bytes = 8589934592\nidle_timeout = 30.0\n")
    out = cli("stats", code=0).output
    rows = out.split("settings:\n", 1)[1].splitlines()
    shown = dict(line.split(None, 1) for line in rows)
    assert shown["max_bytes"] == "8.0 GiB" and "8589934592" not in out
    assert shown["learned_max_bytes"] == "2.0 GiB"
    assert shown["learn_write_bytes_per_day"] == "4.0 GiB/day"
    assert shown["idle_timeout"] == "30 s" and shown["learn"] == "true"
    assert shown["max_connections"] == "32"
    columns = {len(line) - len(line.split(None, 1)[1]) for line in rows}
    assert len(columns) == 1, rows  # every value starts in one column
    settings = json.loads(cli("stats", "--json", code=0).output)["settings"]
    assert settings["max_bytes"] == 8589934592 and settings["idle_timeout"] == 30.0
